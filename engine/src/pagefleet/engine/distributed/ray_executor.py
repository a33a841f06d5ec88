"""The `ray` executor: worker ranks 1..N-1 as Ray actors in one placement group, on one node or
across several (the optional `ray` extra; imported only when this backend is chosen).

Cluster: an already connected Ray driver is used as it is; else `address` (or RAY_ADDRESS,
e.g. `auto` or `<head-ip>:6379` on a LeaderWorkerSet leader) is joined; else a private local
cluster is started (own temp dir, as many logical CPUs as ranks) and stopped at shutdown.
There is no silent probing for some local cluster: on a shared machine it could be anyone's.

Placement: one bundle per rank, `{"GPU": 1}` for NCCL ranks or `{"CPU": 1}` for gloo ranks.
Bundle 0 is rank 0's: it is pinned to the engine's own node (by its `ray.io/node-id` label),
so that Ray never hands the engine's GPU to a worker, and STRICT_PACK means "every rank on the
engine's node". STRICT_PACK when the engine's node holds every rank, else PACK (fill the engine's
node, then others); `placement_strategy` overrides. On GPU a placeholder actor holds bundle 0
and tells rank 0 which GPU Ray gave it (vLLM's driver-dummy-worker); each worker actor sees only
its own GPU (`cuda:0`).

Code: actors import `RankSpec.entry` by module path, so the entry's package must be installed
on every node (the engine image) or be on the PYTHONPATH given in `RankSpec.env` (which becomes
the actors' runtime_env env_vars, applied when their processes start).

Lifetime: the actors belong to the engine's Ray job; Ray kills them when the engine's driver
connection drops, including when the engine is SIGKILLed.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from pagefleet.engine.distributed.executor import DEVICE_ENV, RankSpec, load_entry

log = logging.getLogger(__name__)

PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
NODE_ID_LABEL = "ray.io/node-id"
# The object store of a private local cluster: ranks exchange tensors over torch.distributed,
# not Ray objects, so Ray's default (30% of RAM) would only reserve shared memory for nothing.
LOCAL_OBJECT_STORE_BYTES = 128 * 1024 * 1024


def placement_strategy(world_size: int, engine_node_capacity: float, configured: str | None) -> str:
    """The placement group strategy: the configured one, else STRICT_PACK when the engine's node
    holds all `world_size` ranks' devices, else PACK."""
    if configured is not None:
        if configured not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"unknown placement strategy {configured!r}; "
                f"expected one of {', '.join(PLACEMENT_STRATEGIES)}"
            )
        return configured
    return "STRICT_PACK" if world_size <= engine_node_capacity else "PACK"


def rank_bundles(world_size: int, backend: str, engine_node_id: str) -> tuple[list, list]:
    """One bundle per rank (GPU for nccl, CPU otherwise) and the label selectors pinning bundle 0
    to the engine's node."""
    resource = "GPU" if backend == "nccl" else "CPU"
    bundles = [{resource: 1.0} for _ in range(world_size)]
    selectors = [{NODE_ID_LABEL: engine_node_id}] + [{} for _ in range(world_size - 1)]
    return bundles, selectors


@dataclass(frozen=True)
class RankPlacement:
    """Where a rank runs."""

    rank: int
    node_id: str
    node_ip: str
    pid: int


class RankActor:
    """A worker rank inside a Ray actor (also bundle 0's placeholder on GPU)."""

    def where(self, rank: int) -> RankPlacement:
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        return RankPlacement(rank, node_id, ray.util.get_node_ip_address(), os.getpid())

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(i) for i in ray.get_gpu_ids()]

    def run(self, rank: int, spec: RankSpec) -> None:
        load_entry(spec.entry)(rank, spec)


class RayExecutor:
    """Worker ranks as Ray actors; see the module docstring for cluster and placement rules."""

    def __init__(
        self,
        address: str | None = None,
        placement_strategy: str | None = None,
        num_cpus: int | None = None,
        ready_timeout_s: float = 120.0,
    ) -> None:
        if placement_strategy is not None and placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"unknown placement strategy {placement_strategy!r}")
        self._address = address or os.environ.get("RAY_ADDRESS") or None
        self._strategy = placement_strategy
        self._num_cpus = num_cpus  # logical CPUs of a private local cluster
        self._ready_timeout_s = ready_timeout_s
        self._owns: str | None = None  # "cluster" | "connection" | None (the caller's driver)
        self._temp_dir: str | None = None
        self._group: Any = None
        self._placeholder: Any = None
        self._actors: list[Any] = []
        self._runs: list[Any] = []
        self._placements: list[RankPlacement] = []
        self._stopping = False

    # --- cluster --------------------------------------------------------------------------

    def _joins_cluster(self) -> bool:
        import ray

        return ray.is_initialized() or self._address is not None

    def _connect(self, local_cpus: int) -> None:
        import ray

        if ray.is_initialized():
            return
        if self._address is not None:
            ray.init(address=self._address)
            self._owns = "connection"
            return
        # AF_UNIX socket paths are limited to ~107 bytes: keep the temp dir short.
        self._temp_dir = tempfile.mkdtemp(prefix="pf-ray-", dir="/tmp")
        ray.init(
            num_cpus=self._num_cpus or local_cpus,
            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
            include_dashboard=False,
            _temp_dir=self._temp_dir,
        )
        self._owns = "cluster"

    def master_addr(self) -> str:
        import ray

        if not self._joins_cluster():
            return "127.0.0.1"  # the private local cluster start() brings up is this machine
        self._connect(local_cpus=1)
        return ray.util.get_node_ip_address()

    def rank0_device(self, backend: str) -> str:
        if backend != "nccl":
            return "cpu"
        if self._placeholder is None:
            raise RuntimeError("rank 0's GPU is known once the executor has started")
        import ray

        gpu_ids = ray.get(self._placeholder.gpu_ids.remote(), timeout=self._ready_timeout_s)
        return f"cuda:{gpu_ids[0]}"

    # --- ranks ----------------------------------------------------------------------------

    def start(self, spec: RankSpec) -> None:
        if self._actors:
            raise RuntimeError("executor already started")
        self._connect(local_cpus=spec.world_size)
        try:
            self._place(spec)
            self._launch(spec)
        except BaseException:
            self.shutdown()
            raise

    def _place(self, spec: RankSpec) -> None:
        import ray
        from ray.util.placement_group import placement_group

        node_id = ray.get_runtime_context().get_node_id()
        resource = "GPU" if spec.backend == "nccl" else "CPU"
        capacity = engine_node_capacity(ray.nodes(), node_id, resource)
        strategy = placement_strategy(spec.world_size, capacity, self._strategy)
        bundles, selectors = rank_bundles(spec.world_size, spec.backend, node_id)
        self._group = placement_group(bundles, strategy=strategy, bundle_label_selector=selectors)
        ready, _ = ray.wait([self._group.ready()], timeout=self._ready_timeout_s)
        if not ready:
            raise RuntimeError(
                f"Ray could not place {spec.world_size} ranks ({bundles[0]} each, {strategy}, "
                f"rank 0 on node {node_id}) within {self._ready_timeout_s:.0f}s; "
                f"cluster resources: {ray.cluster_resources()}"
            )
        log.info("placed %d ranks on Ray with %s", spec.world_size, strategy)

    def _launch(self, spec: RankSpec) -> None:
        import ray

        on_gpu = spec.backend == "nccl"
        actor_class = ray.remote(RankActor)
        if on_gpu:
            placeholder_options = actor_options(self._group, 0, on_gpu, dict(spec.env))
            self._placeholder = actor_class.options(**placeholder_options).remote()
        env = {**spec.env, DEVICE_ENV: "cuda:0" if on_gpu else "cpu"}
        self._actors = [
            actor_class.options(**actor_options(self._group, rank, on_gpu, env)).remote()
            for rank in range(1, spec.world_size)
        ]
        self._placements = ray.get(
            [actor.where.remote(rank) for rank, actor in enumerate(self._actors, start=1)],
            timeout=self._ready_timeout_s,
        )
        self._runs = [
            actor.run.remote(rank, spec) for rank, actor in enumerate(self._actors, start=1)
        ]

    @property
    def local_cluster_dir(self) -> str | None:
        """The temp dir of the private local cluster this executor started, if it did."""
        return self._temp_dir

    def placements(self) -> list[RankPlacement]:
        """Where ranks 1..N-1 run, rank 1 first."""
        return list(self._placements)

    def failure(self) -> str | None:
        if self._stopping or not self._runs:
            return None
        import ray

        done, _ = ray.wait(self._runs, num_returns=1, timeout=0)
        if not done:
            return None
        rank = self._runs.index(done[0]) + 1
        where = self._placements[rank - 1]
        prefix = f"tensor-parallel rank {rank} (Ray node {where.node_id[:12]}, pid {where.pid})"
        try:
            ray.get(done[0], timeout=5)
        except ray.exceptions.RayActorError as exc:
            return f"{prefix}: its actor died: {first_line(exc)}"
        except Exception as exc:
            return f"{prefix} failed: {first_line(exc)}"
        return f"{prefix} returned from its entry while the engine runs"

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        import ray

        actors = [a for a in [*self._actors, self._placeholder] if a is not None]
        group = self._group
        # Drop every Ray handle and reference before ray.shutdown(): one released after the
        # core worker is gone makes Ray end the process on the spot, mid-shutdown.
        self._actors, self._runs, self._placeholder, self._group = [], [], None, None
        if ray.is_initialized():
            for actor in actors:
                ray.kill(actor, no_restart=True)
            if group is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(group)
            del actors, group
            if self._owns is not None:
                ray.shutdown()
        self._owns = None
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None


def engine_node_capacity(nodes: list[dict], node_id: str, resource: str) -> float:
    """How many of `resource` the engine's node has, from `ray.nodes()`."""
    for node in nodes:
        if node.get("NodeID") == node_id:
            return float(node.get("Resources", {}).get(resource, 0.0))
    return 0.0


def actor_options(group: Any, bundle: int, on_gpu: bool, env: dict[str, str]) -> dict[str, Any]:
    """Ray options of the actor in `bundle` of the placement group."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "num_cpus": 0 if on_gpu else 1,
        "num_gpus": 1 if on_gpu else 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=bundle
        ),
        "runtime_env": {"env_vars": env},
    }


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
