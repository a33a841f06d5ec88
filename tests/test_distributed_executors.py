"""The tensor-parallel executors on CPU with gloo: worker ranks started by `mp` and by Ray (one
local node, and two Ray "nodes" started by `ray start` on this machine) join rank 0's group and
all-reduce; a dead rank fails the engine instead of hanging it; workers die with the engine.

Rank 0 is this test process (in-process tests) or `tests/tp_engine.py` (a toy engine process)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from pagefleet.engine.distributed import ray_executor as ray_executor_module
from pagefleet.engine.distributed.executor import (
    RankSpec,
    choose_backend,
    free_master_port,
    make_executor,
    node_device_count,
)
from pagefleet.engine.distributed.mp_executor import MpExecutor, describe_exit
from pagefleet.engine.distributed.supervisor import watch
from ray_nodes import RAY_ENV, ray_cluster_of_two_nodes, wait_until
from tp_engine import EVENT_PREFIX
from tp_toy_ranks import all_reduce_rank, join_group

# Ray joins any Ray cluster it finds on the machine: these run beside no other Ray test.
pytestmark = pytest.mark.machine_wide

TESTS_DIR = Path(__file__).resolve().parent
ENGINE_SCRIPT = TESTS_DIR / "tp_engine.py"
# Token auth would write ~/.ray/auth_token (shared by every process on the machine); usage
# stats would try the network.
DEADLINE_S = 60.0


# --- pure rules ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "tp", "devices", "expected"),
    [
        (None, 1, 8, "mp"),
        (None, 8, 8, "mp"),  # fits the node exactly
        (None, 9, 8, "ray"),  # more ranks than the node's GPUs: only Ray reaches other nodes
        (None, 64, None, "mp"),  # CPU ranks: a node holds any number
        ("ray", 2, 8, "ray"),  # asked for
        ("mp", 9, 8, "mp"),  # asked for, even where it will not fit (the runner says so)
    ],
)
def test_choose_backend(requested, tp, devices, expected):
    assert choose_backend(requested, tp, devices) == expected


def test_choose_backend_refuses_unknown_backend_and_size():
    with pytest.raises(ValueError, match="unknown distributed executor backend 'dask'"):
        choose_backend("dask", 2, None)
    with pytest.raises(ValueError, match="tensor parallel size"):
        choose_backend(None, 0, None)
    with pytest.raises(ValueError, match="unknown distributed executor backend"):
        make_executor("dask")


def test_cpu_devices_are_unlimited():
    assert node_device_count("cpu") is None


def test_placement_rule():
    rule = ray_executor_module.placement_strategy
    assert rule(4, 8.0, None) == "STRICT_PACK"
    assert rule(8, 8.0, None) == "STRICT_PACK"
    assert rule(9, 8.0, None) == "PACK"
    assert rule(2, 0.0, None) == "PACK"  # the engine's node has none of the resource
    assert rule(2, 8.0, "STRICT_SPREAD") == "STRICT_SPREAD"
    with pytest.raises(ValueError, match="unknown placement strategy"):
        rule(2, 8.0, "ANYWHERE")
    bundles, selectors = ray_executor_module.rank_bundles(3, "nccl", "n0")
    assert bundles == [{"GPU": 1.0}] * 3
    assert selectors == [{"ray.io/node-id": "n0"}, {}, {}]
    assert ray_executor_module.rank_bundles(2, "gloo", "n0")[0] == [{"CPU": 1.0}] * 2
    nodes = [{"NodeID": "a", "Resources": {"CPU": 4.0}}, {"NodeID": "b", "Resources": {}}]
    assert ray_executor_module.engine_node_capacity(nodes, "a", "CPU") == 4.0
    assert ray_executor_module.engine_node_capacity(nodes, "b", "GPU") == 0.0


def test_describe_exit_names_rank_and_signal():
    assert describe_exit(2, 7, -9) == "tensor-parallel rank 2 (pid 7) was killed by SIGKILL"
    assert describe_exit(1, 7, 1) == "tensor-parallel rank 1 (pid 7) exited with code 1"


# --- helpers ------------------------------------------------------------------------------


def toy_spec(world_size: int, master_addr: str, entry: str = "worker_main") -> RankSpec:
    return RankSpec(
        world_size=world_size,
        master_addr=master_addr,
        master_port=free_master_port(),
        backend="gloo",
        entry=f"tp_toy_ranks:{entry}",
        # Ray actors import the entry by module path: tests/ must be on theirs.
        env={"PYTHONPATH": str(TESTS_DIR)},
    )


def pid_alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def run_rank0_all_reduce(executor, world_size: int) -> float:
    spec = toy_spec(world_size, executor.master_addr())
    executor.start(spec)
    try:
        join_group(0, spec)
        try:
            return all_reduce_rank(0)
        finally:
            dist.destroy_process_group()
    finally:
        executor.shutdown()


class FailureRecorder:
    """An on_failure that records its calls (the engine's exits the process instead)."""

    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.called = threading.Event()

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)
        self.called.set()


class EngineProcess:
    """tests/tp_engine.py as a subprocess; a thread collects its JSON events from stdout."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        # A file, not a pipe: nobody reads stderr while the engine runs, and a full pipe would
        # block the engine's (Ray's) logging.
        self.stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by engine_processes)
        self.proc = subprocess.Popen(
            [sys.executable, str(ENGINE_SCRIPT), *args],
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env={**os.environ, **RAY_ENV, **(env or {})},
        )
        self.events: dict[str, dict] = {}
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read_events, daemon=True)
        self.reader.start()

    def _read_events(self) -> None:
        for line in self.proc.stdout:
            if not line.startswith(EVENT_PREFIX):
                continue
            event = json.loads(line.removeprefix(EVENT_PREFIX))
            with self.changed:
                self.events[event["event"]] = event
                self.changed.notify_all()
        with self.changed:
            self.events.setdefault("eof", {})
            self.changed.notify_all()

    def wait_event(self, name: str, timeout_s: float = DEADLINE_S) -> dict:
        with self.changed:
            self.changed.wait_for(lambda: name in self.events or "eof" in self.events, timeout_s)
            if name in self.events:
                return self.events[name]
        self.kill()
        raise AssertionError(f"no {name!r} event; stderr:\n{self.stderr_text()}")

    def finish(self, timeout_s: float = DEADLINE_S) -> tuple[int, str]:
        """The exit code and stderr, once the process has exited and stdout is read."""
        try:
            returncode = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout_s:.0f}s") from None
        self.reader.join(timeout_s)
        return returncode, self.stderr_text()

    def stderr_text(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def engine_processes() -> Iterator[list[EngineProcess]]:
    started: list[EngineProcess] = []
    yield started
    for engine in started:
        engine.kill()
        engine.stderr.close()


# --- mp -----------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3])
def test_mp_ranks_all_reduce_with_rank0_in_the_engine(world_size):
    """Every worker rank joins rank 0's group: rank 0 sees 0 + 1 + ... + N-1."""
    executor = MpExecutor()
    total = run_rank0_all_reduce(executor, world_size)
    assert total == math.fsum(range(world_size))
    assert executor.failure() is None  # a planned shutdown is no failure


def test_mp_supervisor_reports_a_killed_worker_once():
    executor = MpExecutor()
    executor.start(toy_spec(3, executor.master_addr(), entry="idle_main"))
    recorder = FailureRecorder()
    supervision = watch(executor, recorder, interval_s=0.05)
    try:
        assert executor.failure() is None
        rank2_pid = executor.pids()[1]
        os.kill(rank2_pid, signal.SIGKILL)
        assert recorder.called.wait(DEADLINE_S)
        supervision.thread.join(DEADLINE_S)
        assert not supervision.thread.is_alive()
        assert recorder.reasons == [
            f"tensor-parallel rank 2 (pid {rank2_pid}) was killed by SIGKILL"
        ]
    finally:
        executor.shutdown()
    assert not any(pid_alive(pid) for pid in executor.pids())


def test_supervision_stopped_before_a_planned_shutdown_reports_nothing():
    executor = MpExecutor()
    executor.start(toy_spec(2, executor.master_addr(), entry="idle_main"))
    pids = executor.pids()
    recorder = FailureRecorder()
    supervision = watch(executor, recorder, interval_s=0.05)
    supervision.stop()
    executor.shutdown(timeout_s=10)
    assert not supervision.thread.is_alive()
    assert recorder.reasons == []
    assert not any(pid_alive(pid) for pid in pids)


def test_engine_exits_nonzero_when_a_rank_dies_mid_collective(engine_processes):
    """Catches a hang: rank 0 waits on a live rank while rank 1 is SIGKILLed; the engine must
    report unhealthy (naming rank 1) and exit 1 instead of waiting forever."""
    engine = EngineProcess("--backend", "mp", "--world-size", "3", "--hang")
    engine_processes.append(engine)
    pids = engine.wait_event("ranks")["pids"]
    engine.wait_event("waiting")
    os.kill(pids[0], signal.SIGKILL)
    returncode, err = engine.finish()
    assert returncode == 1, err
    reason = engine.events["unhealthy"]["reason"]
    assert reason.startswith("tensor-parallel rank 1 ") and "SIGKILL" in reason
    assert "returned" not in engine.events
    assert f"engine failed: {reason}" in err  # said loudly on stderr
    wait_until(lambda: not pid_alive(pids[1]), "rank 2 to die with its engine")


def test_mp_workers_die_when_the_engine_is_sigkilled(engine_processes):
    """Catches orphans: SIGKILL leaves the engine no chance to stop its workers itself."""
    engine = EngineProcess("--backend", "mp", "--world-size", "3", "--hang")
    engine_processes.append(engine)
    pids = engine.wait_event("ranks")["pids"]
    engine.wait_event("waiting")
    assert all(pid_alive(pid) for pid in pids)
    engine.proc.send_signal(signal.SIGKILL)
    engine.proc.wait(DEADLINE_S)
    wait_until(lambda: not any(pid_alive(pid) for pid in pids), "orphaned workers to exit")


# --- Ray, one local node ------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_ray() -> Iterator[str]:
    """A bounded local Ray cluster this process drives; yields its GCS address."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="pf-ray-t-", dir="/tmp")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in RAY_ENV.items():
            patch.setenv(name, value)
        ray.init(
            num_cpus=3,
            object_store_memory=80 * 1024 * 1024,
            include_dashboard=False,
            _temp_dir=temp_dir,
        )
        try:
            yield ray.get_runtime_context().gcs_address
        finally:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_ranks_all_reduce_with_rank0_in_the_engine(local_ray):
    """Ray actors as ranks 1 and 2 of a driver this process already runs (its connection stays
    the caller's); the placement group is gone after shutdown."""
    import ray

    world_size = 3
    executor = make_executor("ray")
    total = run_rank0_all_reduce(executor, world_size)
    assert total == math.fsum(range(world_size))
    assert ray.is_initialized()  # the caller's driver connection is left to the caller
    assert ray.util.placement_group_table() and all(
        group["state"] == "REMOVED" for group in ray.util.placement_group_table().values()
    )


def test_ray_supervisor_reports_a_killed_actor(local_ray):
    executor = make_executor("ray")
    executor.start(toy_spec(2, executor.master_addr(), entry="idle_main"))
    recorder = FailureRecorder()
    supervision = watch(executor, recorder, interval_s=0.05)
    try:
        assert executor.failure() is None
        actor_pid = executor.placements()[0].pid
        os.kill(actor_pid, signal.SIGKILL)
        assert recorder.called.wait(DEADLINE_S)
        supervision.thread.join(DEADLINE_S)
        (reason,) = recorder.reasons
        assert reason.startswith("tensor-parallel rank 1 ")
        assert f"pid {actor_pid}" in reason and "actor died" in reason
    finally:
        executor.shutdown()


def test_ray_engine_exits_nonzero_when_an_actor_dies_mid_collective(engine_processes):
    """Catches a hang and a leak: the engine starts its own local Ray cluster (no RAY_ADDRESS),
    rank 1's actor is SIGKILLed while rank 0 waits; the engine reports unhealthy naming rank 1,
    exits 1, and its cleanup leaves no Ray process and no temp dir behind."""
    engine = EngineProcess("--backend", "ray", "--world-size", "3", "--hang")
    engine_processes.append(engine)
    ranks = engine.wait_event("ranks", timeout_s=120)
    cluster_dir = ranks["local_cluster_dir"]
    assert cluster_dir and ranks["master_addr"] == "127.0.0.1"  # a one-machine cluster
    engine.wait_event("waiting")
    assert len(cluster_processes(cluster_dir)) >= 4  # GCS, raylet, agents, actors
    os.kill(ranks["pids"][0], signal.SIGKILL)
    returncode, err = engine.finish()
    assert returncode == 1, err
    reason = engine.events["unhealthy"]["reason"]
    assert reason.startswith("tensor-parallel rank 1 ") and "actor died" in reason
    wait_until(lambda: not pid_alive(ranks["pids"][1]), "rank 2's actor to stop")
    wait_until(lambda: not cluster_processes(cluster_dir), "the engine's Ray cluster to stop")
    assert not Path(cluster_dir).exists()


def cluster_processes(cluster_dir: str) -> list[int]:
    """Live processes of the Ray cluster whose temp dir is `cluster_dir`: named on their command
    line (raylet, GCS) or holding a file open in it (agents retitle themselves `ray::...`)."""
    return [
        pid
        for pid in (int(p.name) for p in Path("/proc").glob("[0-9]*"))
        if pid != os.getpid() and pid_alive(pid) and touches(pid, cluster_dir)
    ]


def touches(pid: int, directory: str) -> bool:
    try:
        if directory.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
            return True
        return any(
            os.readlink(fd).startswith(directory) for fd in Path(f"/proc/{pid}/fd").iterdir()
        )
    except OSError:  # gone meanwhile, or a descriptor closed while listed
        return False


# --- Ray, two nodes -----------------------------------------------------------------------


@pytest.fixture
def two_ray_nodes() -> Iterator[str]:
    with ray_cluster_of_two_nodes() as address:
        yield address


def test_ray_ranks_span_two_nodes(two_ray_nodes, engine_processes):
    """TP=2 over a head and a worker node of one CPU each: rank 0 (the engine, attached to the
    head) and rank 1 (an actor) run on different Ray nodes, meet at rank 0's node IP (not
    loopback) and all-reduce across them."""
    engine = EngineProcess(
        "--backend", "ray", "--world-size", "2", env={"RAY_ADDRESS": two_ray_nodes}
    )
    engine_processes.append(engine)
    returncode, err = engine.finish(timeout_s=120)
    assert returncode == 0, err
    ranks = engine.events["ranks"]
    rank0_node, rank1_node = ranks["nodes"]
    assert rank0_node != rank1_node
    assert ranks["master_addr"] == two_ray_nodes.rsplit(":", 1)[0] != "127.0.0.1"
    assert engine.events["sum"]["value"] == 1.0
    assert "stopped" in engine.events
