"""The engine pod's HTTP face: OpenAI-compatible API, Prometheus metrics, health."""
