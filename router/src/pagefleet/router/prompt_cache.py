"""Tokenize and block-hash prompts for routing, reusing the work done for earlier texts.

Chats resend their whole history each turn and users share long system prompts, so most of a
prompt's text was seen before. The text is cut into fixed character chunks with a chained hash;
for each chunk boundary of a text seen before we remember its tokens up to a safe seam (a
whitespace character after a non-whitespace one: byte-level BPE pre-tokenizers always split
there, so the tokens before it never depend on what follows) and the block hashes over them.
A new text then tokenizes only from the last seam it shares with a seen text.

Tokenizers that do not split at whitespace (some SentencePiece setups) would make seams wrong,
so the cache checks itself on a varied sample at start and against a full tokenization on
the first `verify_first` prompts; a mismatch turns it off (with a warning).
"""

from __future__ import annotations

import itertools
import logging
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from pagefleet.common.block_hash import BlockHash, hash_blocks

logger = logging.getLogger("pagefleet.router")


@dataclass
class _Tokenized:
    """One text's tokens and their block hashes per block size."""

    tokens: array
    hashes: dict[int, list[BlockHash]] = field(default_factory=dict)

    def block_hashes(self, block_size: int, reuse: _Tokenized | None, reused: int) -> list:
        hashes = self.hashes.get(block_size)
        if hashes is None:
            full = reused // block_size if reuse is not None else 0
            hashes = reuse.block_hashes(block_size, None, 0)[:full] if full else []
            parent = hashes[-1] if hashes else None
            hashes += hash_blocks(self.tokens[full * block_size :], block_size, parent)
            self.hashes[block_size] = hashes
        return hashes


@dataclass(frozen=True)
class _Seam:
    record: _Tokenized
    num_tokens: int  # tokens before the seam
    offset: int  # character offset of the seam


class PromptCache:
    def __init__(
        self,
        tokenizer,
        chunk_chars: int = 512,
        max_seams: int = 65536,
        verify_first: int = 8,
    ) -> None:
        self.backend = tokenizer.backend_tokenizer  # the fast (Rust) tokenizer
        self.chunk_chars, self.max_seams = chunk_chars, max_seams
        self.verify_first = verify_first
        self.enabled = self._splits_at_seams()
        self.hits = self.lookups = 0
        self._seams: OrderedDict[int, _Seam] = OrderedDict()

    def encode(
        self, text: str, add_special_tokens: bool, block_size: int
    ) -> tuple[Sequence[int], list[BlockHash]]:
        """Token ids (as a full tokenization gives them; an array, not copied to a list) and
        the chained block hashes of `text`."""
        if not self.enabled:
            return self._full(text, add_special_tokens, block_size)
        keys = self._chunk_keys(text, add_special_tokens)
        seam, matched = self._longest_seam(keys)
        self.lookups += 1
        start, tokens = 0, array("I")
        if seam is not None:
            self.hits += 1
            start, tokens = seam.offset, seam.record.tokens[: seam.num_tokens]
        # Cut the unseen part at the seams of the chunk boundaries beyond `start`, tokenize the
        # pieces (in parallel, in Rust) and note the token count at each seam.
        cuts = [(j, s) for j, s in self._seam_offsets(text, matched, len(keys)) if s > start]
        bounds = [start, *(s for _, s in cuts), len(text)]
        pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
        first_special = add_special_tokens and seam is None
        counts = []
        for k, piece in enumerate(pieces):
            # One encode per piece: encode_batch's thread pool costs more than small pieces.
            tokens.extend(
                self.backend.encode(piece, add_special_tokens=first_special and not k).ids
            )
            counts.append(len(tokens))
        record = _Tokenized(tokens)
        if self.lookups <= self.verify_first:
            full = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
            if list(tokens) != full:
                logger.warning(
                    "prompt cache: this tokenizer does not split at whitespace the way the "
                    "cache assumes; tokenizing every prompt in full from now on"
                )
                self.enabled, self._seams = False, OrderedDict()
                return full, hash_blocks(full, block_size)
        for (j, offset), count in zip(cuts, counts, strict=False):
            self._remember(keys[j], _Seam(record, count, offset))
        reused = seam.num_tokens if seam else 0
        hashes = record.block_hashes(block_size, seam.record if seam else None, reused)
        return tokens, hashes

    def _full(self, text: str, add_special_tokens: bool, block_size: int):
        tokens = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return tokens, hash_blocks(tokens, block_size)

    def _splits_at_seams(self) -> bool:
        """Does tokenizing at seams give the full tokenization on a varied sample text?"""
        sample = (
            "System: you are terse.\n\n  User's  question (v2.1):\tWhat's 12,345 + 6?  "
            "Réponse: naïve café — 東京 ok!!  \n def f(x):\n    return x**2  # end "
        ) * 3
        cuts = [i for i in range(1, len(sample)) if _is_seam(sample, i)][::5]
        pieces = [sample[a:b] for a, b in itertools.pairwise([0, *cuts, len(sample)])]
        joined = self.backend.encode(pieces[0], add_special_tokens=True).ids
        for enc in self.backend.encode_batch(pieces[1:], add_special_tokens=False):
            joined += enc.ids
        if joined != self.backend.encode(sample, add_special_tokens=True).ids:
            logger.warning("prompt cache off: this tokenizer does not split at whitespace")
            return False
        return True

    def _chunk_keys(self, text: str, add_special_tokens: bool) -> list[int]:
        keys, seed, size = [], int(add_special_tokens), self.chunk_chars
        for start in range(0, len(text) - size + 1, size):
            seed = xxhash.xxh3_64_intdigest(
                text[start : start + size].encode("utf-8", "surrogatepass"), seed
            )
            keys.append(seed)
        return keys

    def _seam_offsets(self, text: str, first: int, num_keys: int) -> list[tuple[int, int]]:
        """For chunk boundaries `first`.., the last seam inside the chunk before each one."""
        size, out = self.chunk_chars, []
        for j in range(first, num_keys):
            low, s = j * size, (j + 1) * size - 1
            while s > low and not _is_seam(text, s):
                s -= 1
            if s > low:
                out.append((j, s))
        return out

    def _longest_seam(self, keys: list[int]) -> tuple[_Seam | None, int]:
        """The seam of the longest known chunk prefix, and how many chunk keys matched."""
        found, matched = None, 0
        for key in keys:  # chained: a miss means every later boundary misses too
            seam = self._seams.get(key)
            if seam is None:
                break
            found, matched = seam, matched + 1
            self._seams.move_to_end(key)
        return found, matched

    def _remember(self, key: int, seam: _Seam) -> None:
        if key not in self._seams:
            self._seams[key] = seam
        while len(self._seams) > self.max_seams:
            self._seams.popitem(last=False)


def _is_seam(text: str, offset: int) -> bool:
    return text[offset].isspace() and not text[offset - 1].isspace()
