"""What the router knows about each engine pod, kept fresh by scraping `/metrics`.

A scrape every 50-100 ms reads vLLM's gauges; data older than `stale_after` counts as
unknown (the pod keeps serving and scores as the fleet's mean load); `eject_after` consecutive
failures eject a pod until its `/health` passes again. A changed `process_start_time_seconds`
means the pod restarted: its prefix-index entries are dropped at once. Every `models_interval`
the pod's `/v1/models` says which LoRA adapters it serves (entries with a `parent`, as vLLM
lists them), which change when adapters load at run time.

A pod is ready (routed to) only after a good scrape: one just discovered, or listed with
--endpoints, may still be loading its weights, and a request sent there would be refused. The
proxy ejects a pod at once when a connection to it is refused or reset before the first byte
(`eject`), rather than after `eject_after` scrapes: a dead pod then costs one attempt, not
every request routed to it until the scrapes notice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx

from pagefleet.common.metrics_text import parse_metrics
from pagefleet.router.scoring import Pod

logger = logging.getLogger("pagefleet.router")


@dataclass
class PodStatus:
    pod: Pod
    scraped_at: float = 0.0
    failures: int = 0
    ready: bool = False  # a good scrape since the pod appeared or was ejected
    ejected: bool = False
    block_size: int = 16
    started: float | None = None  # the engine process's start time, to notice restarts
    models_at: float = float("-inf")  # when /v1/models was last read


class PodRegistry:
    def __init__(
        self,
        interval: float = 0.075,
        stale_after: float | None = None,
        eject_after: int = 3,
        timeout: float = 1.0,
        api_key: str | None = None,
        models_interval: float = 1.0,
    ) -> None:
        """`api_key`: what the router presents to engines (their /v1/models asks for it)."""
        # Data is stale once two scrapes were missed, never sooner than 2 s: a slower interval
        # than the default must not leave every pod reading as the fleet's mean between scrapes.
        if stale_after is None:
            stale_after = max(2.0, 2.5 * interval)
        self.interval, self.stale_after = interval, stale_after
        self.api_key, self.models_interval = api_key, models_interval
        self.eject_after, self.timeout = eject_after, timeout
        self.status: dict[str, PodStatus] = {}
        self.on_capacity = None  # callable(pod name, num_gpu_blocks), set by the router
        self.on_lost = None  # callable(pod name): the pod is gone or ejected
        self.on_pods = None  # callable(pods): discovery's new view (KV-event subscribers)
        self.ejections = 0

    def set_pods(self, pods: list[Pod]) -> None:
        """Discovery's current view; pods that vanished are forgotten."""
        new = {p.name: p for p in pods}
        for name in list(self.status):
            if name not in new:
                del self.status[name]
                if self.on_lost:
                    self.on_lost(name)
        for name, pod in new.items():
            if name not in self.status:
                self.status[name] = PodStatus(pod)
        if self.on_pods:
            self.on_pods(pods)

    def adapters(self) -> frozenset[str]:
        """Every LoRA adapter some pod serves."""
        return frozenset().union(*(st.pod.adapters for st in self.status.values()))

    def has_role(self, role: str) -> bool:
        return any(st.pod.role == role for st in self.status.values())

    def block_size(self, name: str) -> int:
        st = self.status.get(name)
        return st.block_size if st is not None else 16

    def eject(self, name: str, why: str) -> None:
        """Stop routing to the pod until its `/health` passes again (a scrape re-admits it)."""
        st = self.status.get(name)
        if st is None or st.ejected:
            return
        logger.warning("pod %s ejected: %s", name, why)
        st.ejected, st.ready = True, False
        self.ejections += 1
        if self.on_lost:
            self.on_lost(name)

    def reachable(self) -> list[Pod]:
        """Pods worth asking a question routing does not hang on (their /v1/models): ready
        ones first, then those not scraped yet; ejected ones not at all."""
        live = [st for st in self.status.values() if not st.ejected]
        return [st.pod for st in sorted(live, key=lambda st: not st.ready)]

    def pods(self, now: float) -> list[Pod]:
        """Pods with their freshest load. A pod whose data is stale reads as the fleet's mean
        load (unknown, neither idle nor busy); one not ready (never scraped, or ejected) reads
        as unhealthy."""
        fresh = [st.pod for st in self.status.values() if now - st.scraped_at <= self.stale_after]
        mean = {
            key: (sum(getattr(p, key) for p in fresh) / len(fresh)) if fresh else 0.0
            for key in ("waiting", "kv_usage")
        }
        result = []
        for st in self.status.values():
            pod = st.pod
            pod.healthy = st.ready
            if now - st.scraped_at > self.stale_after:
                pod.waiting, pod.kv_usage = mean["waiting"], mean["kv_usage"]
            result.append(pod)
        return result

    async def run(self, client: httpx.AsyncClient) -> None:
        while True:
            started = time.monotonic()
            await asyncio.gather(*(self._scrape(client, st) for st in list(self.status.values())))
            await asyncio.sleep(max(self.interval - (time.monotonic() - started), 0.0))

    async def _scrape(self, client: httpx.AsyncClient, st: PodStatus) -> None:
        pod = st.pod
        try:
            if st.ejected:
                r = await client.get(f"{pod.url}/health", timeout=self.timeout)
                if r.status_code != 200:
                    return
                logger.info("pod %s is healthy again; re-admitted", pod.name)
                st.ejected, st.failures = False, 0
            r = await client.get(f"{pod.url}/metrics", timeout=self.timeout)
            r.raise_for_status()
            values = parse_metrics(r.text)
        except (httpx.HTTPError, ValueError):
            st.failures += 1
            if st.failures >= self.eject_after:
                self.eject(pod.name, f"{st.failures} failed scrapes")
            return
        if not st.ready:
            logger.info("pod %s is ready", pod.name)
        st.failures, st.ready = 0, True
        st.scraped_at = time.monotonic()
        started = values.get("started")
        if started is not None and st.started is not None and started != st.started:
            logger.info("pod %s restarted; its cached blocks are gone", pod.name)
            if self.on_lost:
                self.on_lost(pod.name)
        st.started = started if started is not None else st.started
        pod.waiting, pod.kv_usage = float(values["waiting"]), float(values["kv_usage"])
        lora = values.get("lora")
        if lora is not None:
            pod.active_adapters, pod.max_lora = lora["active"], lora["max_lora"]
        if st.scraped_at - st.models_at >= self.models_interval:
            st.models_at = st.scraped_at
            await self._read_models(client, pod)
        cache = values.get("cache")
        if cache:
            blocks = int(float(cache.get("num_gpu_blocks", 0) or 0))
            st.block_size = int(float(cache.get("block_size", 16) or 16))
            pod.caches_prefixes = cache.get("enable_prefix_caching", "True") != "False"
            if blocks and blocks != pod.num_gpu_blocks:
                pod.num_gpu_blocks = blocks
                if self.on_capacity:
                    self.on_capacity(pod.name, blocks)

    async def _read_models(self, client: httpx.AsyncClient, pod: Pod) -> None:
        """The pod's LoRA adapters from its /v1/models (kept as they were if the answer is
        not a model list: the metrics scrape decides whether the pod is up)."""
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            r = await client.get(f"{pod.url}/v1/models", headers=headers, timeout=self.timeout)
            models = served_adapters(r.json()) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return
        if models is not None:
            pod.adapters = models


MAX_MODELS = 4096  # a pod listing more is not believed past this many


def served_adapters(body) -> frozenset[str] | None:
    """The LoRA adapters of an OpenAI /v1/models answer: the entries with a parent (None if
    the answer is no model list)."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    return frozenset(
        card["id"]
        for card in data[:MAX_MODELS]
        if isinstance(card, dict)
        and card.get("parent")
        and isinstance(card.get("id"), str)
        and len(card["id"]) <= 256
    )
