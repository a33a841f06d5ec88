"""KV transfer benchmark (issues 6 and 22).

Part `transfer`: throughput of pulling one prompt's KV blocks from a peer process, for prompts
of 1k, 8k and 32k tokens on a benchmark model's KV shape (Llama-3-8B: 8 KV heads, head dim
128, bf16, block 16; fewer layers by default so two 32k-token pools fit this machine):
pagefleet's NIXL path (NixlTransport: coalesced descriptors, READ, poll) and TCP path (gRPC
ReadBlocks), against a raw in-process memcpy of the same bytes and a bare NIXL READ of the
same bytes as one contiguous descriptor (nixl's API only). Block id layouts (remote, local):
`contiguous` (both one run), `scattered` (local ids a random sample of the pool: one
descriptor per block and plane), and from churned pools (`churned_pool`: a simulated
history of requests coming and going with prefix caching, so free lists are scattered):
`decode-lru` / `decode-runs` take the local ids from a churned decode pool with
BlockPool.allocate (the LRU head, before) or allocate_runs (after), remote ids contiguous;
`pd-lru` / `pd-runs` do the same with remote ids from a churned prefill pool too, taken
chunk by chunk as a prefill engine does (after: local runs laid out like the remote's).
Before, both pools' histories and allocations are LRU; after, every prompt's blocks come from
allocate_runs on both pools (a decode pod's prompts arrive by pulls, a prefill pod's held
prompts are read by them), so the pools churn as the engine now churns them; the simulated
request sizes and free order are the same.

    .venv/bin/python benchmarks/kv_transfer.py --part transfer [--num-layers 8] [--repeats 3]

The peer is this script re-run with --peer (a separate process, as a prefill engine would be).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from pagefleet.common.fleet_auth import FleetSecret
from pagefleet.engine.kv_cache.block_pool import BlockPool, mirror_runs
from pagefleet.engine.kv_transfer.layout import CompatRecord, block_regions
from pagefleet.engine.kv_transfer.nixl_transport import NixlTransport
from pagefleet.engine.kv_transfer.service import KVTransferClient, KVTransferServer, PeerInfo

PORT_MARK = "KV-TRANSFER-PORT"
REQUEST_ID = "bench"
SECRET = FleetSecret(b"benchmark-fleet-secret-0123456789")  # both processes share it


@dataclass(frozen=True)
class KVShape:
    num_layers: int = 8
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_kv_heads, num_blocks, self.block_size, self.head_dim)

    def compat(self) -> CompatRecord:
        return CompatRecord.from_pool_shape("bench", self.dtype, self.dtype, self.pool_shape(1))

    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem


@dataclass(frozen=True)
class TransferRow:
    tokens: int
    layout: str  # how the block ids are laid out (transfer_pairs)
    num_bytes: int
    descriptors: int
    gbps: dict[str, float]  # path -> median GB/s


class _HoldAll:
    """The peer holds every block for one request until the benchmark ends."""

    def __init__(self, num_blocks: int) -> None:
        self._blocks = list(range(num_blocks))

    def blocks_of(self, transfer_id: str, reader: str) -> list[int] | None:
        return self._blocks if transfer_id == REQUEST_ID else None

    def release(self, transfer_id: str, reader: str) -> bool:
        return transfer_id == REQUEST_ID


def serve_peer(shape: KVShape, num_blocks: int) -> None:
    """The prefill-side process: a random pool, its NIXL agent and the gRPC service."""
    pool = torch.randn(shape.pool_shape(num_blocks), dtype=getattr(torch, shape.dtype))
    nixl = NixlTransport(pool, "bench-peer")
    server = KVTransferServer(
        _HoldAll(num_blocks),
        pool,
        shape.compat(),
        "bench-peer",
        secret=SECRET,
        nixl_agent_name=nixl.agent_name,
        nixl_metadata=nixl.metadata(),
    )
    print(PORT_MARK, server.start(), flush=True)
    sys.stdin.read()
    server.stop(grace=0)
    nixl.close()


@contextmanager
def peer_process(shape: KVShape, num_blocks: int):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(shape).items()]
    proc = subprocess.Popen(
        [sys.executable, __file__, "--peer", f"--peer-blocks={num_blocks}", *flags],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith(PORT_MARK):
                break
        else:
            raise RuntimeError(f"peer exited with {proc.wait()}")
        yield int(line.split()[1])
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


def interleaved_gbps(
    num_bytes: int, paths: dict[str, Callable[[], None]], repeats: int
) -> dict[str, float]:
    """Median GB/s of each path, run in rounds (every path once per round) so that load from
    other processes on a shared machine hits all paths alike."""
    for run in paths.values():
        run()  # warm-up: connections, page faults, descriptor caches
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, run in paths.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: num_bytes / statistics.median(t) / 1e9 for name, t in times.items()}


class BareNixlRead:
    """A READ of `num_bytes` from the peer's pool start, as one descriptor, with nixl only."""

    def __init__(self, local_pool: torch.Tensor, peer: PeerInfo) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        # Without NIXL's progress thread, which spins a core; the READ's initiator drives
        # progress itself by polling, as pagefleet's decode side does.
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.agent = nixl_agent("bench-bare", config)
        self.registered = self.agent.register_memory(local_pool)
        self.remote = self.agent.add_remote_agent(peer.nixl_metadata)
        self.local_base = local_pool.data_ptr()
        self.remote_base = peer.pool.base_address

    def __call__(self, num_bytes: int) -> None:
        """One contiguous READ of num_bytes."""
        self.read(
            np.array([[self.local_base, num_bytes, 0]], dtype=np.uint64),
            np.array([[self.remote_base, num_bytes, 0]], dtype=np.uint64),
        )

    def rows(self, regions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Nx3 (address, length, device) rows of given (remote, local, length) regions."""
        local = np.stack([regions[:, 1] + self.local_base, regions[:, 2], 0 * regions[:, 2]], 1)
        remote = np.stack([regions[:, 0] + self.remote_base, regions[:, 2], 0 * regions[:, 2]], 1)
        return local.astype(np.uint64), remote.astype(np.uint64)

    def read(self, local: np.ndarray, remote: np.ndarray) -> None:
        handle = self.agent.initialize_xfer(
            "READ",
            self.agent.get_xfer_descs(local, "DRAM"),
            self.agent.get_xfer_descs(remote, "DRAM"),
            self.remote,
        )
        state = self.agent.transfer(handle)
        while state == "PROC":
            state = self.agent.check_xfer_state(handle)
        handle.release()
        if state != "DONE":
            raise RuntimeError(f"bare NIXL READ ended {state}")


# Local ids from a churned decode pool, LRU head (before) or run-aware (after), with the
# remote ids contiguous ("decode-") or from a churned prefill pool too ("pd-").
CHURNED = ("decode-lru", "decode-runs", "pd-lru", "pd-runs")
PREFILL_CHUNK_BLOCKS = 128  # max_num_batched_tokens 2048 / block 16: one prefill chunk


def churned_pool(
    num_blocks: int, seed: int, runs: bool, rounds: int = 400
) -> tuple[BlockPool, list]:
    """A pool after `rounds` requests of random length came and went: allocated chunk by
    chunk (from the LRU head, or in runs), full blocks cached (prefix caching), freed
    tail-first when done in random order; as a serving engine's pool looks after a while, its
    LRU list scattered over ids. Returns the pool and the tables still live."""
    rng = random.Random(seed)
    pool = BlockPool(num_blocks)
    live: list[list[int]] = []
    next_hash = 0
    for _ in range(rounds):
        size = rng.randint(1, max(1, num_blocks // 8))
        while pool.num_free_blocks < size:
            pool.free(live.pop(rng.randrange(len(live))))
        table = allocate_chunked(pool, size, runs)
        hashes = [(next_hash + i).to_bytes(8, "big") for i in range(size)]
        next_hash += size
        pool.cache_blocks(table, hashes, None, [], 1)
        live.append(table)
    return pool, live


def allocate_chunked(pool: BlockPool, num: int, runs: bool) -> list[int]:
    """A prompt's blocks as a prefill engine takes them: one prefill chunk at a time."""
    take = pool.allocate_runs if runs else pool.allocate
    table: list[int] = []
    while len(table) < num:
        table += take(min(PREFILL_CHUNK_BLOCKS, num - len(table)))
    return table


def churned_pool_with_room(num_blocks: int, seed: int, num: int, runs: bool) -> BlockPool:
    """churned_pool, then requests finished (random order) until `num` blocks are free."""
    pool, live = churned_pool(num_blocks, seed, runs)
    rng = random.Random(seed + 1)
    while pool.num_free_blocks < num:
        pool.free(live.pop(rng.randrange(len(live))))
    return pool


def transfer_pairs(layout: str, num: int, pool_blocks: int, seed: int = 0) -> list:
    """(remote, local) block id pairs of one prompt's transfer in the given layout."""
    if layout in CHURNED:
        runs = layout.endswith("-runs")
        if layout.startswith("pd-"):
            remote_pool = churned_pool_with_room(pool_blocks, seed, num, runs)
            remote = allocate_chunked(remote_pool, num, runs)
        else:
            remote = list(range(num))
        local_pool = churned_pool_with_room(pool_blocks, seed + 100, num, runs)
        if not runs:
            local = local_pool.allocate(num)
        else:
            local = mirror_runs(local_pool.allocate_runs(num), remote)
        return list(zip(remote, local, strict=True))
    if layout == "contiguous":
        local = list(range(num))
    else:
        local = random.Random(seed).sample(range(pool_blocks), num)
    return list(zip(range(num), local, strict=True))


def run_transfer_throughput(
    prompt_tokens: tuple[int, ...] = (1024, 8192, 32768),
    shape: KVShape | None = None,
    layouts: tuple[str, ...] = ("contiguous", "scattered", *CHURNED),
    repeats: int = 5,
    pool_tokens: int = 0,
) -> list[TransferRow]:
    """Median GB/s of each path for each prompt size and block id layout; both pools hold
    max(pool_tokens, the longest prompt) tokens."""
    shape = shape or KVShape()
    num_blocks = max(pool_tokens, *prompt_tokens) // shape.block_size
    local_pool = torch.zeros(shape.pool_shape(num_blocks), dtype=getattr(torch, shape.dtype))
    rows: list[TransferRow] = []
    with (
        peer_process(shape, num_blocks) as port,
        KVTransferClient("127.0.0.1", port, timeout=600, secret=SECRET) as client,
        NixlTransport(local_pool, "bench-decode") as nixl,
    ):
        info = client.handshake(shape.compat(), "bench-decode")
        peer = nixl.add_peer(info.nixl_metadata, info.pool, info.compat, info.nixl_agent_name)
        bench = _Paths(
            local_pool,
            client,
            nixl,
            peer,
            BareNixlRead(local_pool, info),
        )
        for tokens in prompt_tokens:
            n = tokens // shape.block_size
            num_bytes = n * shape.block_size * shape.bytes_per_token()
            for layout in layouts:
                if layout in CHURNED and 2 * n > num_blocks:
                    continue  # a prompt of more than half the pool leaves nothing to churn
                pairs = transfer_pairs(layout, n, num_blocks)
                # The same descriptors as ours, computed outside the timed READ.
                regions = block_regions(peer.geometry, nixl.geometry, pairs)
                paths = {
                    "memcpy": partial(bench.memcpy, num_bytes),
                    "bare NIXL": partial(bench.bare, num_bytes),
                    "bare NIXL, our descriptors": partial(
                        bench.bare.read, *bench.bare.rows(regions)
                    ),
                    "pagefleet NIXL": partial(bench.nixl, pairs),
                    "pagefleet TCP": partial(bench.tcp, pairs),
                }
                gbps = interleaved_gbps(num_bytes, paths, repeats)
                row = TransferRow(tokens, layout, num_bytes, bench.last_descriptors, gbps)
                print(format_row(row), flush=True)
                rows.append(row)
    return rows


class _Paths:
    """The four ways of moving one prompt's bytes into the local pool."""

    def __init__(self, local_pool, client, nixl, peer, bare) -> None:
        self.dst = local_pool.view(-1).view(torch.uint8)
        self.src = torch.randn_like(local_pool).view(-1).view(torch.uint8)
        self.local_pool = local_pool
        self.client = client
        self.transport = nixl
        self.peer = peer
        self.bare = bare
        self.last_descriptors = 0

    def memcpy(self, num_bytes: int) -> None:
        self.dst[:num_bytes].copy_(self.src[:num_bytes])

    def nixl(self, pairs: list[tuple[int, int]]) -> None:
        handle = self.transport.start_read(self.peer, pairs)
        self.transport.wait(handle, timeout=600)
        self.transport.release(handle)
        self.last_descriptors = handle.num_descriptors

    def tcp(self, pairs: list[tuple[int, int]]) -> None:
        self.client.read_blocks_tcp(REQUEST_ID, pairs, self.local_pool)


TABLE_HEADER = (
    "| prompt | block ids | MiB | descriptors | memcpy | bare NIXL | bare NIXL, our descs "
    "| pagefleet NIXL | pagefleet TCP | NIXL / bare NIXL | NIXL / bare, our descs "
    "| NIXL / memcpy | TCP / memcpy |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def format_row(row: TransferRow) -> str:
    g = row.gbps
    ours = g["pagefleet NIXL"]
    return (
        f"| {row.tokens // 1024}k | {row.layout} | {row.num_bytes / 2**20:,.0f} "
        f"| {row.descriptors:,} | {g['memcpy']:.2f} | {g['bare NIXL']:.2f} "
        f"| {g['bare NIXL, our descriptors']:.2f} | {ours:.2f} | {g['pagefleet TCP']:.2f} "
        f"| {ours / g['bare NIXL']:.0%} | {ours / g['bare NIXL, our descriptors']:.0%} "
        f"| {ours / g['memcpy']:.0%} | {g['pagefleet TCP'] / g['memcpy']:.0%} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part",
        choices=["transfer", "latency"],
        default="transfer",
        help="transfer: throughput vs memcpy and bare NIXL; latency: colocated vs "
        "disaggregated TTFT/ITL (benchmarks/pd_latency.py, which takes its own flags)",
    )
    parser.add_argument("--num-layers", type=int, default=KVShape.num_layers)
    parser.add_argument("--num-kv-heads", type=int, default=KVShape.num_kv_heads)
    parser.add_argument("--head-dim", type=int, default=KVShape.head_dim)
    parser.add_argument("--block-size", type=int, default=KVShape.block_size)
    parser.add_argument("--dtype", default=KVShape.dtype)
    parser.add_argument("--tokens", default="1024,8192,32768", help="prompt sizes")
    parser.add_argument(
        "--layouts",
        default="contiguous,scattered," + ",".join(CHURNED),
        help="block id layouts (see the module docstring); churned ones only for prompts "
        "of at most half the pool",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--pool-tokens", type=int, default=0, help="KV pool size (default: the longest prompt)"
    )
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--peer-blocks", type=int, default=0, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.part == "latency":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import pd_latency

        sys.argv = [sys.argv[0], *rest]
        pd_latency.main()
        return 0
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    shape = KVShape(args.num_layers, args.num_kv_heads, args.head_dim, args.block_size, args.dtype)
    if args.peer:
        serve_peer(shape, args.peer_blocks)
        return 0
    if args.part == "transfer":
        print(f"KV shape {shape}: {shape.bytes_per_token() / 1024:.0f} KiB per token; GB/s:")
        print(TABLE_HEADER)
        run_transfer_throughput(
            tuple(int(t) for t in args.tokens.split(",")),
            shape,
            tuple(args.layouts.split(",")),
            args.repeats,
            args.pool_tokens,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
