"""Quantized weight formats: which linear method (model/linear.py) each layer of a checkpoint
gets, the methods (FP8, INT8, weight-only INT4/INT8) and their kernels."""
