"""Router flow control: the bounded, fair queue of requests held while no engine of their model
can take one (none ready, as at zero replicas, or every ready one saturated).

Pure: no I/O and no clock of its own. The app holds a request by pushing it with an opaque
waiter, settles the waiters this module hands back (released, or past their deadline), and
takes a request out when its client leaves. Order: per model, round robin across tenants in
the order they became waiting (so the oldest request goes first), FIFO within a tenant.

Everything a client controls is bounded: the queue per model (`queue_size`), the tenants
tracked per model (beyond `max_tenants` the newcomers share one overflow tenant), the models
tracked when the router accepts any (beyond `max_models`, or for an overlong name, one shared
label), and a tenant key is a fixed-size hash of the header or bearer token, never the text.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pagefleet.common.names import TENANT_HEADER
from pagefleet.router.scoring import Candidate, Pod

OVERFLOW_TENANT = "~overflow"  # the tenants beyond max_tenants share this one
SHARED_TENANT = "~shared"  # requests with neither a tenant header nor a bearer token
OTHER_MODEL = "~other"  # the models beyond max_models, and overlong names
MAX_MODEL_CHARS = 128
# Requests released per unsaturated pod and round when only the KV threshold applies (the
# waiting threshold gives its own headroom): a burst small enough not to swamp a waking pod.
KV_RELEASE_BURST = 8


@dataclass(frozen=True)
class FlowConfig:
    queue_size: int = 256  # per model; 0: never hold (503 at once)
    queue_timeout: float = 120.0  # seconds a request may be held
    saturation_waiting: float | None = None  # vllm:num_requests_waiting >= this: saturated
    saturation_kv: float | None = None  # vllm:kv_cache_usage_perc >= this: saturated
    tenant_header: str = TENANT_HEADER
    max_tenants: int = 64  # per model
    max_models: int = 32

    def __post_init__(self) -> None:
        if self.queue_size < 0 or self.max_tenants < 1 or self.max_models < 1:
            raise ValueError("queue size must be >= 0, tenant and model bounds >= 1")
        if not self.queue_timeout > 0:
            raise ValueError(f"queue timeout must be > 0 seconds, not {self.queue_timeout}")
        if self.saturation_waiting is not None and not self.saturation_waiting > 0:
            raise ValueError("the saturation waiting threshold must be > 0")
        if self.saturation_kv is not None and not 0 < self.saturation_kv <= 1:
            raise ValueError("the saturation KV threshold must be in (0, 1]")


@dataclass(eq=False)  # identity: two held requests are never the same one
class Held:
    """One held request."""

    model: str  # its model label
    tenant: str
    enqueued_at: float
    deadline: float
    waiter: object = None  # the app's handle to wake it


def tenant_of(header: str | None, authorization: str | None) -> str:
    """A fixed-size key for a request's tenant: its tenant header, else its bearer token,
    else the shared tenant. Hashed, so neither a long header nor a key is kept."""
    if header:
        return "h:" + _digest(header)
    if authorization and authorization.lower().startswith("bearer "):
        return "k:" + _digest(authorization[7:])
    return SHARED_TENANT


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=8).hexdigest()


class FairQueue:
    """One model's held requests: at most `capacity`, from at most `max_tenants` tenants."""

    def __init__(self, capacity: int, max_tenants: int) -> None:
        self.capacity, self.max_tenants = capacity, max_tenants
        # tenant -> its requests, oldest first; the dict's order is the round-robin turn
        self._tenants: OrderedDict[str, deque[Held]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def tenants(self) -> int:
        return len(self._tenants)

    def push(self, item: Held) -> bool:
        """Hold `item` at the end of its tenant's line; False when the queue is full."""
        if self._size >= self.capacity:
            return False
        if item.tenant not in self._tenants and len(self._tenants) >= self.max_tenants:
            item.tenant = OVERFLOW_TENANT
        self._tenants.setdefault(item.tenant, deque()).append(item)
        self._size += 1
        return True

    def pop(self) -> Held | None:
        """The next request to release: the head of the tenant whose turn it is."""
        if not self._tenants:
            return None
        tenant, line = next(iter(self._tenants.items()))
        item = line.popleft()
        if line:
            self._tenants.move_to_end(tenant)
        else:
            del self._tenants[tenant]
        self._size -= 1
        return item

    def remove(self, item: Held) -> bool:
        """Take `item` out (its client left); False if it was not held."""
        line = self._tenants.get(item.tenant)
        if line is None or item not in line:
            return False
        line.remove(item)
        if not line:
            del self._tenants[item.tenant]
        self._size -= 1
        return True

    def expire(self, now: float) -> list[Held]:
        """Take out the requests whose deadline has passed (anywhere in a line: a request held
        again after its engine refused it keeps its first deadline)."""
        expired = []
        for tenant in list(self._tenants):
            line = self._tenants[tenant]
            if any(item.deadline <= now for item in line):
                expired += [item for item in line if item.deadline <= now]
                line = self._tenants[tenant] = deque(i for i in line if i.deadline > now)
            if not line:
                del self._tenants[tenant]
        self._size -= len(expired)
        return expired

    def oldest(self) -> float | None:
        """When the oldest held request came (each tenant's head is its oldest)."""
        return min((line[0].enqueued_at for line in self._tenants.values()), default=None)


@dataclass
class Settled:
    """What the app does with a batch of held requests: wake these, refuse those."""

    released: list[Held] = field(default_factory=list)
    expired: list[Held] = field(default_factory=list)


class FlowControl:
    """Every model's queue, the saturation rule, and the release budget."""

    def __init__(self, config: FlowConfig, model: str | None = None) -> None:
        self.config = config
        self.queues: dict[str, FairQueue] = {}
        self.held = 0  # across models: the hot path reads this alone
        self._saturation = config.saturation_waiting is not None or config.saturation_kv is not None
        if model is not None:  # the router's own model reads 0 from the start
            self.queue_of(model_label(model))

    @property
    def enabled(self) -> bool:
        return self.config.queue_size > 0

    def label(self, model: str) -> str:
        """The model's label here: its name while fewer than max_models are tracked."""
        name = model_label(model)
        if name in self.queues or len(self.queues) < self.config.max_models:
            return name
        return OTHER_MODEL

    def queue_of(self, label: str) -> FairQueue:
        queue = self.queues.get(label)
        if queue is None:
            queue = self.queues[label] = FairQueue(self.config.queue_size, self.config.max_tenants)
        return queue

    def must_hold(self, model: str, candidates: list[Candidate]) -> bool:
        """Whether a request for `model` with these candidates waits in the queue: no engine,
        every one saturated, or earlier requests of its model still waiting (no jumping)."""
        if not self.enabled:
            return False
        if not candidates:
            return True
        if self.held and len(self.queues.get(self.label(model), ())):
            return True
        return self._saturation and all(self.saturated(c.pod) for c in candidates)

    def saturated(self, pod: Pod) -> bool:
        waiting, kv = self.config.saturation_waiting, self.config.saturation_kv
        return (waiting is not None and pod.waiting >= waiting) or (
            kv is not None and pod.kv_usage >= kv
        )

    def release_budget(self, ready: Iterable[Pod]) -> int:
        """How many held requests the ready pods take this round: all of them without a
        saturation rule; else the unsaturated pods' headroom under the waiting threshold
        (KV_RELEASE_BURST each under the KV threshold alone)."""
        free = [p for p in ready if not self.saturated(p)]
        if not free:
            return 0
        if not self._saturation:
            return self.held
        waiting = self.config.saturation_waiting
        if waiting is None:
            return KV_RELEASE_BURST * len(free)
        return sum(max(1, math.ceil(waiting - p.waiting)) for p in free)

    def hold(
        self, model: str, tenant: str, waiter: object, now: float, deadline: float | None = None
    ) -> Held | None:
        """Hold a request until `deadline` (default: queue_timeout from now); None when its
        model's queue is full."""
        label = self.label(model)
        deadline = now + self.config.queue_timeout if deadline is None else deadline
        item = Held(label, tenant, now, deadline, waiter)
        if not self.queue_of(label).push(item):
            return None
        self.held += 1
        return item

    def release(self, label: str, budget: int) -> list[Held]:
        """Up to `budget` of the model's held requests, in their turn."""
        queue, released = self.queues.get(label), []
        while queue and len(released) < budget:
            released.append(queue.pop())
        self.held -= len(released)
        return released

    def leave(self, item: Held) -> bool:
        """Take out a request whose client left; False if it had already been settled."""
        queue = self.queues.get(item.model)
        if queue is None or not queue.remove(item):
            return False
        self.held -= 1
        return True

    def expire(self, now: float) -> list[Held]:
        expired = [item for queue in self.queues.values() for item in queue.expire(now)]
        self.held -= len(expired)
        return expired

    def settle(self, now: float, ready_of: Callable[[str], list[Pod]]) -> Settled:
        """One round: refuse the requests past their deadline, then release what each
        model's ready pods (`ready_of(label)`) can take."""
        settled = Settled(expired=self.expire(now))
        for label in [label for label, queue in self.queues.items() if len(queue)]:
            settled.released += self.release(label, self.release_budget(ready_of(label)))
        return settled

    def stats(self, now: float) -> dict[str, tuple[int, float]]:
        """Per model label: requests held, and the age of the oldest (0 when none)."""
        result = {}
        for label, queue in self.queues.items():
            oldest = queue.oldest()
            result[label] = (len(queue), 0.0 if oldest is None else max(now - oldest, 0.0))
        return result


def model_label(model: str) -> str:
    return model if len(model) <= MAX_MODEL_CHARS else OTHER_MODEL
