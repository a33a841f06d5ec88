"""The n-gram (prompt lookup) proposer: drafts are what followed an earlier occurrence of the
request's last n tokens, longest n first (vLLM's `ngram` method)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NgramProposer:
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int

    def propose(self, tokens: list[int], max_tokens: int) -> list[int]:
        """Up to min(k, max_tokens) drafts to follow `tokens`; [] when no n-gram recurs."""
        k = min(self.num_speculative_tokens, max_tokens)
        if k <= 0:
            return []
        longest = min(self.prompt_lookup_max, len(tokens) - 1)
        for n in range(longest, self.prompt_lookup_min - 1, -1):
            start = find_earlier(tokens, n, k)
            if start >= 0:
                return tokens[start + n : start + n + k]
        return []


def find_earlier(tokens: list[int], n: int, k: int) -> int:
    """Start of an occurrence of tokens[-n:] that ends before the last token, or -1: the
    latest one followed by k tokens, else the earliest (followed by the most). The latest
    continues most like the recent text; but in a loop of period p < k it is followed by only
    p tokens, and an earlier turn of the same loop proposes all k."""
    suffix = tokens[-n:]
    first = suffix[0]
    found = -1
    i = len(tokens) - n - 1
    while i >= 0:
        if tokens[i] == first and tokens[i : i + n] == suffix:
            found = i
            if len(tokens) - (i + n) >= k:
                return i
        i -= 1
    return found
