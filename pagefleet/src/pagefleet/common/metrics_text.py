"""Reading an engine's Prometheus /metrics page: the gauges the router scores pods by and the
operator scales pools by (vLLM's names, so stock vLLM pods read the same)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

# Sample name -> the key it adds to.
_GAUGES = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
}
_LORA_INFO = "vllm:lora_requests_info"
_READ = (*_GAUGES, "process_start_time_seconds", "vllm:cache_config_info", _LORA_INFO)
# What one engine's LoRA info may tell at most (a pod's page is hostile input too).
MAX_ADAPTER_NAMES = 256
MAX_ADAPTER_NAME = 256


def _wanted_lines(text: str) -> str:
    """The sample lines of the few series read. A page holds hundreds of histogram samples and
    the router reads it every 75 ms on its event loop: the full parser on every line cost
    milliseconds a scrape (issue 23); a prefix test per line costs microseconds."""
    lines = []
    for line in text.splitlines():
        if line.startswith(_READ):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in _READ:
                lines.append(line)
    return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict[str, float | dict]:
    """The gauges the router uses, from a vLLM-compatible /metrics page (summed over models);
    "lora": the adapters of running and waiting requests and max_lora, when the page has
    them."""
    out: dict[str, float | dict] = {"waiting": 0.0, "running": 0.0, "kv_usage": 0.0}
    newest_lora = None
    for family in text_string_to_metric_families(_wanted_lines(text)):
        for sample in family.samples:
            key = _GAUGES.get(sample.name)
            if key is not None:
                out[key] = (
                    max(float(out[key]), sample.value)
                    if key == "kv_usage"
                    else (float(out[key]) + sample.value)
                )
            elif sample.name == "process_start_time_seconds":
                out["started"] = sample.value
            elif sample.name == "vllm:cache_config_info":
                out["cache"] = dict(sample.labels)
            elif sample.name == _LORA_INFO and (newest_lora is None or sample.value >= newest_lora):
                # vLLM keeps a series per combination it ever reported, each valued the time
                # it was last set: the newest is the current one.
                newest_lora = sample.value
                out["lora"] = lora_info(sample.labels)
    return out


def lora_info(labels: dict[str, str]) -> dict:
    """vllm:lora_requests_info's labels: {"active": adapters of running and waiting requests,
    "max_lora": adapters one step runs (0 if unreadable)}."""
    names = set()
    for key in ("running_lora_adapters", "waiting_lora_adapters"):
        for name in labels.get(key, "").split(",")[:MAX_ADAPTER_NAMES]:
            if name and len(name) <= MAX_ADAPTER_NAME:
                names.add(name)
    try:
        max_lora = min(max(int(labels.get("max_lora", "0")), 0), 1 << 16)
    except ValueError:
        max_lora = 0
    return {"active": frozenset(names), "max_lora": max_lora}
