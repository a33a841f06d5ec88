"""Draft-model proposer: a smaller checkpoint of the same tokenizer guesses k tokens greedily
over its own KV pool, indexed by the target's block ids (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagefleet.engine.attention.backend import AttentionMetadata, PrefillChunk, single_groups
from pagefleet.engine.request import Request
from pagefleet.engine.runner import ModelRunner


@dataclass
class _Seen:
    """Tokens of a request whose draft keys/values sit in its blocks, and those blocks."""

    num_tokens: int
    block_ids: list[int]


@dataclass
class _Row:
    """One request's proposal work in a call: its block table (owned blocks, then scratch)."""

    req: Request
    start: int  # first token the draft has not seen
    num_drafts: int
    table: list[int]


class DraftModelProposer:
    """Proposes with a draft model. Its pool has the target's blocks (same ids) plus scratch
    blocks: positions past a request's allocated blocks (the drafts, and the last token when
    its block is not allocated yet) are written there and forgotten after the call.

    Validity: a request's draft KV is trusted only for tokens it wrote in this request's
    blocks, only while those blocks are still the request's (preemption gives new ones) and
    while no other request's draft wrote them since (a prefix hit shares blocks; it also
    covers a freed block handed back to the same request). Anything else is recomputed, so
    the first proposal for a request prefills the draft over its whole context."""

    def __init__(self, runner: ModelRunner, num_blocks: int, num_speculative_tokens: int) -> None:
        """`runner`'s pool holds `num_blocks` shared blocks then the scratch blocks."""
        self.runner = runner
        self.num_blocks = num_blocks
        self.k = num_speculative_tokens
        self._seen: dict[str, _Seen] = {}
        self._writer: list[str | None] = [None] * num_blocks

    @staticmethod
    def scratch_blocks(max_num_seqs: int, k: int, block_size: int) -> int:
        """Scratch blocks one call may need: per request, its drafts' positions and the block
        of its last token."""
        return max_num_seqs * (k // block_size + 2)

    @torch.inference_mode()
    def propose_batch(self, requests: list[Request], rooms: list[int]) -> list[list[int]]:
        """Greedy drafts for decoding `requests` (at most min(k, room) each)."""
        # Requests not asked for now are forgotten (recomputed if they come back).
        self._seen = {r.request_id: s for r in requests if (s := self._seen.get(r.request_id))}
        if not requests:
            return []
        rows = self._plan(requests, rooms)
        drafts: list[list[int]] = [[] for _ in rows]
        tokens = self._catch_up(rows)
        for i, token in enumerate(tokens):
            drafts[i].append(token)
        for j in range(1, self.k):
            live = [i for i, row in enumerate(rows) if row.num_drafts > j]
            if not live:
                break
            tokens = self._decode([rows[i] for i in live], [drafts[i][-1] for i in live], j)
            for i, token in zip(live, tokens, strict=True):
                drafts[i].append(token)
        return drafts

    def _plan(self, requests: list[Request], rooms: list[int]) -> list[_Row]:
        bs = self.runner.block_size
        scratch = self.num_blocks
        rows = []
        for req, room in zip(requests, rooms, strict=True):
            num_drafts = min(self.k, room)
            n = req.num_tokens
            owned = req.block_ids
            # The last draft is never fed back: positions up to n + num_drafts - 2 are written.
            need = (n + num_drafts - 1 + bs - 1) // bs
            extra = max(0, need - len(owned))
            table = [*owned[:need], *range(scratch, scratch + extra)]
            scratch += extra
            # At least the last token is run: its logits give the first draft.
            start = min(self._valid_tokens(req), n - 1)
            rows.append(_Row(req, start, num_drafts, table))
        return rows

    def _valid_tokens(self, req: Request) -> int:
        """How many of `req`'s first tokens have trustworthy draft KV (see the class doc)."""
        entry = self._seen.get(req.request_id)
        if entry is None:
            return 0
        bs = self.runner.block_size
        for i, block in enumerate(entry.block_ids):
            if (
                i >= len(req.block_ids)
                or req.block_ids[i] != block
                or self._writer[block] != req.request_id
            ):
                return min(entry.num_tokens, i * bs)
        return entry.num_tokens

    def _catch_up(self, rows: list[_Row]) -> list[int]:
        """Run every request's unseen tokens (one prefill chunk each); the first drafts."""
        bs = self.runner.block_size
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        chunks: list[PrefillChunk] = []
        last_rows: list[int] = []
        dev = self.runner.device
        for row in rows:
            req, start = row.req, row.start
            n = req.num_tokens - start
            input_ids.extend(req.all_token_ids[start:])
            pos = torch.arange(start, req.num_tokens)
            positions.append(pos)
            table = torch.tensor(row.table[: (req.num_tokens + bs - 1) // bs])
            slots.append(table[pos // bs] * bs + pos % bs)
            chunks.append(PrefillChunk(len(input_ids) - n, n, start, table.to(dev)))
            last_rows.append(len(input_ids) - 1)
            self._note_written(req, row.table)
        meta = AttentionMetadata(torch.cat(slots).to(dev), None, 0, [], chunks)
        return self._forward(input_ids, torch.cat(positions), meta, last_rows)

    def _note_written(self, req: Request, table: list[int]) -> None:
        """Record that the draft now holds `req`'s tokens in its own blocks."""
        bs = self.runner.block_size
        owned = [b for b in table if b < self.num_blocks]
        num_tokens = min(req.num_tokens, len(owned) * bs)
        blocks = owned[: (num_tokens + bs - 1) // bs]
        for block in blocks:
            self._writer[block] = req.request_id
        self._seen[req.request_id] = _Seen(num_tokens, blocks)

    def _decode(self, rows: list[_Row], tokens: list[int], j: int) -> list[int]:
        """Feed each row's draft j - 1 (at position num_tokens + j - 1); the next drafts."""
        bs = self.runner.block_size
        order = sorted(range(len(rows)), key=lambda i: rows[i].req.num_tokens)
        positions = [rows[i].req.num_tokens + j - 1 for i in order]
        tables = [rows[i].table[: p // bs + 1] for i, p in zip(order, positions, strict=True)]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
        lens = torch.tensor([p + 1 for p in positions], dtype=torch.int64)
        dev = self.runner.device
        meta = AttentionMetadata(
            torch.tensor(slots, dtype=torch.int64, device=dev),
            None,
            len(rows),
            single_groups(tables, lens, self.runner.block_size, dev),
            [],
        )
        ids = [tokens[i] for i in order]
        sorted_out = self._forward(ids, torch.tensor(positions), meta, list(range(len(rows))))
        out = [0] * len(rows)
        for place, i in enumerate(order):
            out[i] = sorted_out[place]
        return out

    def _forward(
        self, input_ids: list[int], positions: torch.Tensor, meta, rows: list[int]
    ) -> list[int]:
        runner = self.runner
        dev = runner.device
        hidden = runner.model(
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions.to(dev),
            runner.backend,
            runner.kv_caches,
            meta,
        )
        logits = runner.model.compute_logits(hidden[torch.tensor(rows, device=dev)])
        return logits.argmax(dim=-1).tolist()
