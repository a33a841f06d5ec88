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
_READ = (*_GAUGES, "process_start_time_seconds", "vllm:cache_config_info")


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
    """The gauges the router uses, from a vLLM-compatible /metrics page (summed over models)."""
    out: dict[str, float | dict] = {"waiting": 0.0, "running": 0.0, "kv_usage": 0.0}
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
    return out
