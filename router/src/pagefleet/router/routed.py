"""One routed request and the hooks that keep the router's books on it.

A `RoutedRequest` carries what routing saw (block hashes per block size, the plugins' view,
the candidates in the picker's order), where it went (one `Attempt` per pod it was sent to:
a prefill pod, then the serving pod and any retries), the P/D decision and the outcome.

The bookkeeping around sending a request to a pod lives in hooks, as in llm-d's endpoint
picker (its PreRequest and ResponseComplete plugins): each hook's `before` runs when an
attempt is dispatched, its `after` once when the attempt's outcome is known, whatever it is
(an answer relayed, a failure before the first byte, a client gone). Later decisions see the
books at once: the prefix index predicts the blocks the pod will hold, the pod's in-flight
counts grow; a pod that never took the request gives its predicted blocks back.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import Counter

from pagefleet.common.block_hash import BlockHash
from pagefleet.router.prefix_index import PrefixIndex
from pagefleet.router.scoring import Candidate, RoutingRequest

SERVE, PREFILL = "serve", "prefill"  # what an attempt asks of its pod


class Outcome(enum.Enum):
    RELAYED = "relayed"  # the pod answered (< 500) and its answer went to the client
    REFUSED = "refused"  # no connection or a 5xx before the first byte: the pod never took it
    CLIENT_LEFT = "client_left"  # the client went away first (the pod saw its request cut)
    PREFILLED = "prefilled"  # a prefill pod holds the prompt's blocks for the decode pod
    PREFILL_FAILED = "prefill_failed"  # the decode pod prefills itself


@dataclass
class Attempt:
    """The request sent to one pod."""

    candidate: Candidate
    stage: str = SERVE  # SERVE | PREFILL
    retry: bool = False  # another pod failed this request before
    recorded: list[BlockHash] = field(default_factory=list)  # prefix-index entries it added
    outcome: Outcome | None = None

    @property
    def pod_name(self) -> str:
        return self.candidate.pod.name


@dataclass
class RoutedRequest:
    """A client request on its way through the router."""

    path: str
    body: dict
    hashes: dict[int, list[BlockHash]]  # block size -> the prompt's block hashes
    routing: RoutingRequest  # what the filters and scorers see
    candidates: list[Candidate]  # the picker's order: its choice, then fallbacks
    payload: bytes = b""  # what goes to the serving pod, and with which headers
    headers: dict[str, str] = field(default_factory=dict)
    pd: str | None = None  # the P/D decision (disaggregated, decode_only, ...), if one was made
    kv_transfer_params: dict | None = None  # from the prefill pod, for the decode pod
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def blocks(self) -> int:
        """Prompt blocks, in the smallest block size (the unit the scorers count in)."""
        return len(self.routing.block_hashes)

    @property
    def chosen(self) -> Candidate | None:
        """The pod the request was last sent to."""
        return self.attempts[-1].candidate if self.attempts else None

    @property
    def outcome(self) -> Outcome | None:
        return self.attempts[-1].outcome if self.attempts else None


class RequestHook(Protocol):
    def before(self, routed: RoutedRequest, attempt: Attempt) -> None: ...

    def after(self, routed: RoutedRequest, attempt: Attempt) -> None: ...


class Hooks:
    """The hook list, run in order before an attempt and in reverse order after it."""

    def __init__(self, hooks: Sequence[RequestHook]) -> None:
        self.hooks = list(hooks)

    def dispatch(self, routed: RoutedRequest, candidate: Candidate, stage: str = SERVE) -> Attempt:
        retry = any(a.stage == stage for a in routed.attempts)
        attempt = Attempt(candidate, stage, retry)
        routed.attempts.append(attempt)
        for hook in self.hooks:
            hook.before(routed, attempt)
        return attempt

    def finish(self, routed: RoutedRequest, attempt: Attempt, outcome: Outcome) -> None:
        """Settle an attempt's books; only its first outcome counts."""
        if attempt.outcome is not None:
            return
        attempt.outcome = outcome
        for hook in reversed(self.hooks):
            hook.after(routed, attempt)


class PrefixRecording:
    """The prefix index learns what the pod will cache as soon as the request leaves (so a
    burst of one prompt spreads by load instead of piling onto a pod that has yet to report
    it), and forgets it if the pod never took the request."""

    EXPIRE_EVERY = 1.0  # seconds between sweeps of expired speculative entries

    def __init__(
        self, index: PrefixIndex, block_size: Callable[[str], int], clock: Callable[[], float]
    ) -> None:
        self.index, self.block_size, self.clock = index, block_size, clock
        self._expired_at = 0.0

    def before(self, routed: RoutedRequest, attempt: Attempt) -> None:
        now = self.clock()
        if now - self._expired_at > self.EXPIRE_EVERY:
            self.index.expire(now)
            self._expired_at = now
        # A pod whose block size changed since the decision has no hashes to predict; one
        # that caches no prefixes (a mean-pooling embedding engine) will hold none of them.
        hashes = routed.hashes.get(self.block_size(attempt.pod_name), ())
        if not attempt.candidate.pod.caches_prefixes:
            hashes = ()
        attempt.recorded = self.index.record(attempt.pod_name, hashes, now)

    def after(self, routed: RoutedRequest, attempt: Attempt) -> None:
        if attempt.outcome is Outcome.REFUSED:
            self.index.unrecord(attempt.pod_name, attempt.recorded)


class InflightLoad:
    """The pod's in-flight requests and prompt blocks, which the scorers read between
    scrapes."""

    def before(self, routed: RoutedRequest, attempt: Attempt) -> None:
        attempt.candidate.pod.begin(routed.blocks)

    def after(self, routed: RoutedRequest, attempt: Attempt) -> None:
        attempt.candidate.pod.end(routed.blocks)


class AdapterRecording:
    """A pod sent a LoRA adapter's request loads it into one of its slots: the affinity
    scorer learns it at once, not at the pod's next scrape (a burst of one adapter's requests
    then stays together)."""

    def before(self, routed: RoutedRequest, attempt: Attempt) -> None:
        adapter = routed.routing.adapter
        if adapter is not None:
            attempt.candidate.pod.sent_adapter(adapter)

    def after(self, routed: RoutedRequest, attempt: Attempt) -> None:
        pass


@dataclass
class DispatchCounters:
    requests: Counter  # per pod
    prompt_blocks: Counter
    predicted_hit_blocks: Counter
    scorer_contribution: Counter  # per scorer
    retries: Counter


class DispatchMetrics:
    """Counts every attempt as it leaves: per pod, its blocks, its predicted hits, what each
    scorer contributed to the choice, and retries."""

    def __init__(self, counters: DispatchCounters) -> None:
        self.counters = counters

    def before(self, routed: RoutedRequest, attempt: Attempt) -> None:
        c = self.counters
        if attempt.retry:
            c.retries.inc()
        c.requests.labels(attempt.pod_name).inc()
        c.prompt_blocks.inc(routed.blocks)
        c.predicted_hit_blocks.inc(routed.routing.prefix_matches.get(attempt.pod_name, 0))
        for scorer, value in attempt.candidate.contributions.items():
            c.scorer_contribution.labels(scorer).inc(value)

    def after(self, routed: RoutedRequest, attempt: Attempt) -> None:
        pass
