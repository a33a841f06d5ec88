"""One sequence's grammar state: an llguidance matcher advanced by the tokens the sequence
keeps. It lives on the `Request`, so preemption (which recomputes keys/values but keeps the
output tokens) keeps it as it is."""

from __future__ import annotations

import llguidance
import torch


class SequenceGrammar:
    def __init__(self, compiled: llguidance.LLMatcher) -> None:
        self.matcher = compiled.deep_copy()

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (EOS aside)."""
        return self.matcher.is_stopped()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 words, bit i = token i).
        Straight to the matcher, not through `llguidance.torch`: importing that compiles
        nothing we use but pulls in torch._dynamo, seconds of every engine's start."""
        words = bitmask[row]
        if bitmask.dtype != torch.int32 or not bitmask.is_cpu or not words.is_contiguous():
            raise ValueError("a grammar bitmask is a contiguous int32 CPU tensor")
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def fill_draft_rows(self, bitmask: torch.Tensor, first: int, drafts: list[int]) -> None:
        """Masks of a verify step: row first+j holds what may follow drafts[:j]. The matcher
        walks through the drafts and back, ending where it began."""
        self.fill(bitmask, first)
        consumed = 0
        for j, token in enumerate(drafts, 1):
            if not self.matcher.consume_token(token):
                break  # drafts are cut at the first rejected token before a step; defensive
            consumed += 1
            self.fill(bitmask, first + j)
        if consumed:
            self.matcher.rollback(consumed)

    def accept(self, tokens: list[int]) -> bool:
        """Advance over tokens the sequence kept; False if the grammar rejects one."""
        return self.matcher.consume_tokens(tokens)

    def draft_prefix(self, drafts: list[int]) -> int:
        """How many leading drafts are worth verifying: those the grammar allows, short of one
        that would complete it (that one comes as the verified token instead, so the request
        ends on it as it would without speculation). State unchanged."""
        valid = self.matcher.validate_tokens(drafts)  # consuming a bad token would break it
        consumed = 0
        for token in drafts[:valid]:
            self.matcher.consume_token(token)
            consumed += 1
            if self.matcher.is_stopped():
                break
        keep = consumed - 1 if self.matcher.is_stopped() else consumed
        if consumed:
            self.matcher.rollback(consumed)
        return keep
