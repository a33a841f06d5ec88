"""Linear attention (Gated DeltaNet) at run time: the per-sequence state pool and the kernels
that read and update it (torch on CPU, Triton on GPU). The layer itself is
model/gated_deltanet.py; which slot holds whose state is the KV manager's decision."""
