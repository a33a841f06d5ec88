"""The n-gram (prompt lookup) proposer: drafts are what followed the most recent earlier
occurrence of the request's last n tokens, longest n first (vLLM's `ngram` method)."""

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
            start = find_last_earlier(tokens, n)
            if start >= 0:
                return tokens[start + n : start + n + k]
        return []


def find_last_earlier(tokens: list[int], n: int) -> int:
    """Start of the latest occurrence of tokens[-n:] that ends before the last token, or -1."""
    suffix = tokens[-n:]
    first = suffix[0]
    # Scan right to left: the latest match continues most like the recent text.
    i = len(tokens) - n - 1
    while i >= 0:
        if tokens[i] == first and tokens[i : i + n] == suffix:
            return i
        i -= 1
    return -1
