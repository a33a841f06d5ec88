"""Reading an engine's Prometheus /metrics page: the gauges the router scores pods by and the
operator scales pools by (vLLM's names, so stock vLLM pods read the same)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def parse_metrics(text: str) -> dict[str, float | dict]:
    """The gauges the router uses, from a vLLM-compatible /metrics page (summed over models)."""
    out: dict[str, float | dict] = {"waiting": 0.0, "running": 0.0, "kv_usage": 0.0}
    names = {
        "vllm:num_requests_waiting": "waiting",
        "vllm:num_requests_running": "running",
        "vllm:kv_cache_usage_perc": "kv_usage",
        "vllm:gpu_cache_usage_perc": "kv_usage",
    }
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = names.get(sample.name)
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
