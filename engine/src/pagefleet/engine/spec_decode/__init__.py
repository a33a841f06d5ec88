"""Speculative decoding: a cheap proposer guesses tokens, the target model checks them all in
one forward, and a rejection sampler keeps the output distribution the target's own.

Design (n-gram and draft-model proposers; the seams below are where the rest plugs in):

* Proposals. After a step's tokens are applied, the engine asks the proposer for up to
  ``num_speculative_tokens`` draft tokens per running request that is decoding and has not
  opted out (`proposals_useful`), and stores them on ``Request.spec_token_ids``. The n-gram
  proposer (`ngram.py`, vLLM's prompt lookup) finds the most recent earlier occurrence of the
  request's last ``prompt_lookup_max``..``prompt_lookup_min`` tokens and proposes what followed
  it. It is pure Python over the token list: no KV, no forward.
* Scheduler (scheduler.py). A decoding request with drafts is scheduled for ``1 + k`` tokens:
  its last sampled token and k drafts, with k cut so that the budget
  (``max_num_batched_tokens``) pays for every speculative token and the request cannot pass
  ``max_len`` even if all are accepted. Its KV slots are allocated for all ``1 + k`` rows up
  front (the lookahead), from free blocks only: when they are not there the request decodes
  plainly this step, so guesses never preempt anyone (vLLM preempts for them; a recompute
  costs more than a verification saves). Drafts are dropped on preemption (a resumed request
  recomputes, then proposes again).
* Verification. The runner lays a speculating request out as ``1 + k`` single-token rows
  (input ids: last token then drafts, at consecutive positions), sorted and grouped with the
  batch's decode rows: the attention backend writes every row's keys and values into the pool
  before any row attends, so row i reads the rows before it exactly as a decode would, and ONE
  forward of the target covers decodes, verifications and prefill chunks together. Logits
  come back at all ``1 + k`` rows of a verification (other requests: only their last row).
  `rejection.py` then keeps the longest accepted prefix plus one token from the target:
  greedy accepts a draft iff it is the target's argmax; sampling accepts draft d with
  probability ``min(1, p(d) / q(d))`` - for n-gram drafts q is a point mass, so ``p(d)`` - and
  on rejection draws from ``max(0, p - q)`` renormalised, where p is the target's
  distribution after temperature, top-k, top-p and min-p. Emitted tokens are distributed
  exactly as non-speculative sampling; logprobs reported are the target's raw ones.
* Given back. `Scheduler.update_from_output` counts as computed only the last token and the
  accepted drafts; the KV written for rejected drafts sits past ``num_computed_tokens`` and is
  overwritten before anything reads it, and whole blocks past the request's tokens are freed
  back to the pool at once. Block hashes are made as tokens are appended (accepted tokens only),
  and `cache_computed_blocks` registers only full blocks below ``num_computed_tokens``, so no
  block holding an unverified token is ever hashed, cached or announced in a KV event.
  A stop token, a stop string or ``max_tokens`` inside the accepted run cuts the run there.
* Opt-out (no proposals): requests with repetition/presence/frequency penalties (the penalty at
  each draft position depends on the drafts before it; not built), requests still under
  ``min_tokens`` (the stop-token mask depends on the position), prefill-side P/D requests that
  hold their blocks. n > 1, seeds, logprobs and stop strings speculate.
* Seeds. A seeded request draws its acceptance uniforms and residual samples from its own
  generator, so it is reproducible run to run with speculation on; it does not reproduce the
  token stream of the same seed with speculation off (vLLM makes no such promise either).
* Draft model (`draft.py`). A smaller checkpoint of the same tokenizer (vocab size and eos
  ids checked at start-up) with its own `ModelRunner` and KV pool, on the target's device and
  dtype, indexed by the SAME block ids as the target's: the scheduler's one allocation
  (lookahead included) covers both models, and frees, preemption and block tables stay one
  piece of bookkeeping. The draft pool has the target's number of blocks plus scratch blocks
  (per running request ``k // block_size + 2``): positions past a request's allocated blocks
  (its drafts, and its last token when that block comes only with the next step's lookahead)
  are written there and forgotten after the call. It is extra memory next to the target's
  pool (not taken out of the target's budget: for a 2-layer draft of an 8-layer target, about
  a quarter more). After each step the proposer runs, batched over the decoding requests, one
  forward with every request's tokens the draft has not seen (a prefill chunk each: the
  previous step's accepted tokens, or the whole context the first time), then ``k - 1``
  single-token forwards of its own greedy drafts. Its KV of a request is trusted only for
  tokens it wrote into that request's blocks while they are still the request's and no other
  request's draft wrote them since; a request not proposed for in a step is forgotten. So a
  prefix hit (the draft pool's copy of a cached block may hold nothing valid), a preemption
  (new blocks) or a block freed and handed back are all recomputed: the first proposal for a
  request prefills the draft over its whole context. Drafts are greedy (q is a point mass),
  so the rejection sampler above serves both methods. EAGLE-style heads plug in at the same
  seam (`verifier.propose`), fed the target's last hidden states, which the runner would
  return next to the logits; they need no KV of their own beyond one layer, kept in the same
  block ids.
* Backends: a verification is 1 + k single rows and both attention backends (torch, Triton)
  write every row's keys and values before any row attends, so the drafts written in a step
  are read by the rows after them. CUDA graphs are captured up to max_num_seqs x (1 + k) rows
  (capped by the token budget), so verify steps replay the decode graphs; larger steps, steps
  mixed with prefill chunks and the draft model's forwards run eagerly (checked in the Triton
  interpreter; never yet on a GPU).
* Memory: the draft is loaded before the target's pool is sized; the budget (the GPU's, or
  --kv-cache-memory) pays for one draft block per target block plus scratch.
* Load: no drafts while disable_by_batch_size requests or more run (vLLM's key); a draft model
  on CPU pauses at 8 by default (benchmarks/spec_decode.py: its forwards cost more than they
  save there). n-gram lookups cost next to nothing and get no default.
* Refused at start-up (`EngineArgs._check_speculation`): ``--simulate`` and ``draft_model``
  under tensor parallelism (its runner is one rank's; untested). The fp8 KV cache (target
  only: the draft's pool is in the model's dtype) and the CPU offload tier work. Tensor
  parallelism works unchanged for n-gram: rank 0 prepares the verify rows and broadcasts them
  as rows (distributed/step_codec.py). In P/D the decode engine speculates on the KV it pulled
  (a draft model computes its own KV of the prompt there); a prefill engine (kv_producer)
  ignores the flag with a log line, since it computes one token a request.
"""
