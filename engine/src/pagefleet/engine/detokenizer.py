"""Incremental detokenisation and stop strings, one `Detokenizer` per generated sequence.

Each new token's text is the difference between decoding a short window with and without it,
so the cost per token is constant and multi-token characters (bytes of one UTF-8 character
split over tokens) are only emitted once complete.
"""

from __future__ import annotations

# Prompt tokens kept as left context: tokenizers that drop a leading space on the first token
# of a decode need a token before the ones being read.
_CONTEXT_TOKENS = 5


class Detokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        # The fast tokenizer's backend decodes without transformers' per-call checks (which
        # cost more than the decode itself at one call per token).
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.cleanup = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        # Characters that may still turn out to start a stop string are held back in streams.
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        if self.backend is None:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)
        text = self.backend.decode(ids, skip_special_tokens=self.skip_special)
        return self.tokenizer.clean_up_tokenization(text) if self.cleanup else text

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append a token; returns the stop string it completed (text is cut there), or None.
        `check_stop` False (below min_tokens) lets stop strings pass."""
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return None  # an incomplete character, or a token with no text (special)
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        start = max(len(self.text) - self.holdback, 0)
        self.text += delta
        return self._check_stop(start) if self.stop and check_stop else None

    def flush(self) -> None:
        """At the end of a sequence, emit what is held back for an incomplete character."""
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) > len(prefix):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset = len(self.tokens)

    def _check_stop(self, search_from: int) -> str | None:
        found = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) != -1]
        if not found:
            return None
        idx, stop = min(found)  # the earliest stop string wins
        self.text = self.text[: idx + len(stop)] if self.include_stop else self.text[:idx]
        return stop

    def stream_text(self, finished: bool) -> str:
        """Text that is safe to send now: all of it once finished, else minus the holdback."""
        if finished or not self.holdback:
            return self.text
        return self.text[: max(len(self.text) - self.holdback, 0)]
