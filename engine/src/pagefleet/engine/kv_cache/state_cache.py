"""Per-sequence recurrent state as the KV manager keeps it, for hybrid models (linear-attention
layers beside attention layers): pure Python, decisions only (the runner carries them out,
linear_attn/state.py).

- **Slots.** A fixed pool of state slots, sized with the KV pool. A request takes one when it
  is admitted (with its blocks, all or nothing) and gives it back when it finishes, is
  preempted or aborted; a prefill pod's request holding its KV for a decode pod gives its slot
  back once the state is written into KV blocks (P/D moves the state inside blocks).
- **Prefix snapshots.** A recurrent state cannot be cut back to a shorter prefix, so a prefix
  hit needs the state at the hit's boundary. Snapshots of it are kept, in spare slots, at block
  boundaries under the block's hash: the last boundary before a request's final token (a
  repeated or continued prompt hits there), and the end of an attention hit that had no
  snapshot (a prefix two requests shared: the next one sharing it hits). A hit is cut back to
  the longest prefix whose boundary has a snapshot; the blocks past it are recomputed, so they
  are not counted as hit tokens. Snapshots are evicted least recently used when a slot is
  needed.
- **Speculative decoding.** A request verifying k drafts takes up to k spare slots for the
  step: the state after each draft is saved there, and once the drafts are judged the state
  after the last kept one becomes the sequence's (the rest of the verification is rolled
  back). Without spare slots it verifies fewer drafts.
- **Moves.** What the runner must do to slots around the next forward pass: zero a new
  sequence's slot, copy a snapshot into a hit's slot, load a pulled state from KV blocks,
  snapshot at positions inside the step, store a prefill's state into KV blocks.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagefleet.common.block_hash import BlockHash

if TYPE_CHECKING:
    from pagefleet.engine.request import Request


@dataclass
class StateMoves:
    """Slot work around a forward pass, applied in field order: zero `resets`, fill slots from
    KV blocks (`loads`), make `copies` (src, dst) in order, write slots into KV blocks
    (`stores`)."""

    resets: list[int] = field(default_factory=list)
    loads: list[tuple[int, list[int]]] = field(default_factory=list)  # (slot, blocks)
    copies: list[tuple[int, int]] = field(default_factory=list)
    stores: list[tuple[int, list[int]]] = field(default_factory=list)  # (slot, blocks)

    def __bool__(self) -> bool:
        return bool(self.resets or self.loads or self.copies or self.stores)


@dataclass
class StateStep:
    """One step's state decisions: moves before and after the forward pass, and per request
    the positions whose state (after that many tokens) is copied to a slot."""

    before: StateMoves = field(default_factory=StateMoves)
    after: StateMoves = field(default_factory=StateMoves)
    saves: dict[str, list[tuple[int, int]]] = field(default_factory=dict)


@dataclass(frozen=True)
class StateConfig:
    """A hybrid engine's state pool as the KV manager sees it."""

    num_slots: int
    transfer_blocks: int  # KV blocks one state travels in (P/D)
    slot_blocks: float  # one slot's bytes, in KV blocks (for usage)


class StateSlots:
    """Slot allocator: free slots, snapshots (block hash -> slot, least recently used first)
    and pins (snapshots a pending copy reads: never evicted until it ran)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a hybrid model needs state slots, got {num_slots}")
        self.num_slots = num_slots
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.snapshots: OrderedDict[BlockHash, int] = OrderedDict()
        self.pins: Counter[int] = Counter()

    def available(self) -> int:
        """Slots `take` can give: free ones and unpinned snapshots."""
        pinned = sum(1 for slot in self.snapshots.values() if self.pins[slot])
        return len(self.free) + len(self.snapshots) - pinned

    def take(self) -> int | None:
        if self.free:
            return self.free.pop()
        for block_hash, slot in self.snapshots.items():
            if not self.pins[slot]:
                del self.snapshots[block_hash]
                return slot
        return None

    def give(self, slot: int) -> None:
        self.free.append(slot)

    def snapshot_of(self, block_hash: BlockHash) -> int | None:
        slot = self.snapshots.get(block_hash)
        if slot is not None:
            self.snapshots.move_to_end(block_hash)
        return slot

    def publish(self, block_hash: BlockHash, slot: int) -> None:
        """Keep `slot` as the snapshot at `block_hash` (a second one for it is given back)."""
        if block_hash in self.snapshots:
            self.give(slot)
        else:
            self.snapshots[block_hash] = slot

    def clear_snapshots(self) -> int:
        """Drop every snapshot nobody is about to read; returns how many."""
        dropped = [h for h, slot in self.snapshots.items() if not self.pins[slot]]
        for block_hash in dropped:
            self.give(self.snapshots.pop(block_hash))
        return len(dropped)

    @property
    def num_in_use(self) -> int:
        """Slots held by sequences (neither free nor a snapshot)."""
        return self.num_slots - len(self.free) - len(self.snapshots)


@dataclass
class _Fill:
    """How a request's slot gets its starting state before its next forward pass."""

    kind: str  # "reset" | "copy" | "load"
    source: int = -1  # copy: a snapshot's slot (pinned), or a draft's (given back after)
    blocks: list[int] = field(default_factory=list)  # load: the KV blocks it arrived in
    release: bool = False  # copy: the source is the request's own draft slot

    def let_go(self, slots: StateSlots) -> None:
        """The copy will not run (or has): unpin a snapshot, or give a draft's slot back."""
        if self.kind != "copy":
            return
        if self.release:
            slots.give(self.source)
        else:
            slots.pins[self.source] -= 1


@dataclass
class _AfterStep:
    """Bookkeeping for when the step that carried the moves has run."""

    publish: list[tuple[BlockHash, int]] = field(default_factory=list)
    release: list[int] = field(default_factory=list)  # transfer slots
    copied: list[_Fill] = field(default_factory=list)  # their sources are let go
    loaded: list[Request] = field(default_factory=list)  # their transport blocks are free now


class StateCache:
    def __init__(self, config: StateConfig, block_size: int, prefix_caching: bool) -> None:
        self.config = config
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.slots = StateSlots(config.num_slots)
        self._fills: dict[str, _Fill] = {}
        self._requests: dict[str, Request] = {}  # those with a pending fill
        self._after = _AfterStep()

    # ------------------------------------------------------------------ admission

    def hit_limit(self, request: Request) -> int:
        """Most tokens a hit may cover: at least one token must still be computed (its logits),
        and a prefill pod's request must pass its prompt's last token (the state it hands
        over is the one before it)."""
        if request.hold_blocks:
            return request.num_prompt_tokens - 1
        return request.num_tokens - 1

    def usable_hits(self, request: Request, hits: list) -> list:
        """The leading blocks of an attention hit whose end has a state snapshot (cut to the
        longest such prefix). Records where the attention hit ended, to snapshot there."""
        bs = self.block_size
        limit = self.hit_limit(request) // bs
        n = min(len(hits), limit)
        while n and self.slots.snapshots.get(hits[n - 1].block_hash) is None:
            n -= 1
        request.state_saves = [(min(len(hits), limit) * bs, -1)] if n < len(hits) else []
        return hits[:n]

    def slots_needed(self, request: Request) -> int:
        return 2 if request.hold_blocks else 1  # a prefill pod's: one for the hand-off

    def can_admit(self, request: Request, hits: list) -> bool:
        hit_slot = self._hit_snapshot(hits)
        spare = self.slots.available() - (1 if hit_slot is not None else 0)
        return spare >= self.slots_needed(request)

    def admit(self, request: Request, hits: list) -> None:
        """Give the request its slot (can_admit said there is one) and decide its fill and
        its snapshot positions."""
        hit_slot = self._hit_snapshot(hits)
        if hit_slot is not None:
            self.slots.snapshot_of(hits[-1].block_hash)  # a hit refreshes it
            self.slots.pins[hit_slot] += 1  # before take(): it must not be evicted
        request.state_slot = self.slots.take()
        start = len(hits) * self.block_size
        fill = _Fill("copy", hit_slot) if hit_slot is not None else _Fill("reset")
        self._set_fill(request, fill)
        request.state_saves = self._save_points(request, start)

    def _hit_snapshot(self, hits: list) -> int | None:
        return self.slots.snapshots.get(hits[-1].block_hash) if hits else None

    def _save_points(self, request: Request, start: int) -> list[tuple[int, int]]:
        """(position, reserved slot or -1: a snapshot slot taken when reached), ascending."""
        bs = self.block_size
        points: dict[int, int] = {}
        if self.prefix_caching:
            branch = [p for p, _ in request.state_saves]  # set by usable_hits
            for position in (*branch, (request.num_tokens - 1) // bs * bs):
                if start < position:
                    points[position] = -1
        if request.hold_blocks:
            points[request.num_prompt_tokens - 1] = self.slots.take()
        return sorted(points.items())

    # ------------------------------------------------------------------ P/D

    def remote_arrived(self, request: Request, ok: bool) -> list[int]:
        """A pulled prompt landed (ok) or not. On success its state loads from the transport
        blocks before the next forward pass; on failure the blocks are returned now (the
        request computes its prompt from its local hit). Returns blocks to free now."""
        if not ok:
            blocks, request.state_block_ids = request.state_block_ids, []
            return blocks
        self._set_fill(request, _Fill("load", blocks=list(request.state_block_ids)))
        return []

    # ------------------------------------------------------------------ the step

    def step(self, scheduled: list[tuple[Request, int]]) -> StateStep:
        """The moves the runner makes in this step: every pending fill, then the snapshots and
        hand-offs the scheduled chunks pass."""
        out = StateStep()
        for rid, fill in self._fills.items():
            slot = self._requests[rid].state_slot
            if fill.kind == "reset":
                out.before.resets.append(slot)
            elif fill.kind == "copy":
                out.before.copies.append((fill.source, slot))
                self._after.copied.append(fill)
            else:
                out.before.loads.append((slot, fill.blocks))
                self._after.loaded.append(self._requests[rid])
        self._fills.clear()
        self._requests.clear()
        for req, n in scheduled:
            if req.state_saves:
                self._emit_saves(req, req.num_computed_tokens + n, out)
            if req.state_drafts:  # the state after the last token, then after each draft
                first = req.num_computed_tokens + 1
                saves = out.saves.setdefault(req.request_id, [])
                saves += [(first + i, slot) for i, slot in enumerate(req.state_drafts)]
        return out

    def _emit_saves(self, req: Request, end: int, out: StateStep) -> None:
        """Saves at positions up to `end` (the state there is computed in this step). Points
        the sequence passed without computing them (a decode pod's pulled prompt) are gone."""
        due = [point for point in req.state_saves if point[0] <= end]
        req.state_saves = req.state_saves[len(due) :]
        start = req.num_computed_tokens
        for position, reserved in due:
            if position < start:
                if reserved >= 0:
                    self.slots.give(reserved)
                continue
            if reserved >= 0:  # the hand-off to a decode pod: into its transport blocks
                out.saves.setdefault(req.request_id, []).append((position, reserved))
                out.after.stores.append((reserved, list(req.state_block_ids)))
                self._after.release.append(reserved)
                continue
            block_hash = req.block_hashes[position // self.block_size - 1]
            if block_hash in self.slots.snapshots:
                continue
            slot = self.slots.take()
            if slot is None:
                continue  # every slot is a sequence's: no snapshot this time
            out.saves.setdefault(req.request_id, []).append((position, slot))
            self._after.publish.append((block_hash, slot))

    def step_done(self) -> list[int]:
        """The step ran: snapshots become visible, hand-off slots and pins are released.
        Returns transport blocks to free (states that were loaded from them)."""
        after, self._after = self._after, _AfterStep()
        for block_hash, slot in after.publish:
            self.slots.publish(block_hash, slot)
        for slot in after.release:
            self.slots.give(slot)
        for fill in after.copied:
            fill.let_go(self.slots)
        freed = []
        for req in after.loaded:
            freed += req.state_block_ids
            req.state_block_ids = []
        return freed

    # ------------------------------------------------------------------ speculation

    def reserve_drafts(self, request: Request, num_drafts: int) -> int:
        """Take a slot per draft the request verifies this step, as many as are spare (the
        rest of its drafts wait); returns how many it verifies."""
        n = min(num_drafts, self.slots.available())
        request.state_drafts = [self.slots.take() for _ in range(n)]
        return n

    def verified(self, request: Request, num_accepted: int) -> None:
        """The drafts are judged: the state after the last kept one (draft `num_accepted`,
        or the step's last row when all were kept, already in the slot) becomes the
        sequence's before its next step; the other draft slots go back now."""
        drafts, request.state_drafts = request.state_drafts, []
        kept = drafts[num_accepted] if num_accepted < len(drafts) else None
        for slot in drafts:
            if slot != kept:
                self.slots.give(slot)
        if kept is not None:
            self._set_fill(request, _Fill("copy", kept, release=True))

    # ------------------------------------------------------------------ leaving

    def drop(self, request: Request) -> None:
        """The request no longer runs (finished, preempted, aborted, or handed over): its
        slot, reserved hand-off slot and pending fill go; its KV blocks are the caller's."""
        fill = self._fills.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)
        if fill is not None:
            fill.let_go(self.slots)
        for slot in request.state_drafts:
            self.slots.give(slot)
        request.state_drafts = []
        if request.state_slot >= 0:
            self.slots.give(request.state_slot)
            request.state_slot = -1
        for _, reserved in request.state_saves:
            if reserved >= 0:
                self.slots.give(reserved)
        request.state_saves = []

    def _set_fill(self, request: Request, fill: _Fill) -> None:
        old = self._fills.get(request.request_id)
        if old is not None:
            old.let_go(self.slots)  # superseded (a pulled state replaces a local hit's)
        self._fills[request.request_id] = fill
        self._requests[request.request_id] = request

    @property
    def usage_blocks(self) -> float:
        """Slots held by sequences, in KV blocks' worth of bytes."""
        return self.slots.num_in_use * self.config.slot_blocks
