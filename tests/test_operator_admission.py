"""Capacity admission: a ModelDeployment whose GPU pool's KV cache cannot hold one request of
its max-model-len (or that sets none) is refused before any object is applied, with the
numbers and the knobs that fix it; admitAnyway deploys it. The GPU type comes from
spec.capacity or the pool's nvidia.com/gpu.product nodeSelector, the model's shape from
spec.capacity.modelConfig or an hf:// model's config.json (fetched from tests/hf_stand_in.py,
never the internet); a check that cannot run says so and deploys."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Callable

import pytest
from operator_harness import (
    MD_API,
    NS,
    condition,
    emulator,
    get,
    md_status,
    model_deployment,
    next_pass,
    operator,
    wait_degraded,
    wait_for,
)
from test_capacity import HYBRID_27B
from test_capacity import QWEN25_7B as QWEN_7B
from test_helm_chart import helm, one, template, validate_model_deployment  # noqa: F401

from hf_stand_in import HfStandIn
from pagefleet.operator.admission import (
    MAX_CACHED_CONFIGS,
    MAX_CONFIG_BYTES,
    MAX_REDIRECTS,
    CapacityUnknown,
    ModelConfigs,
    check_capacity,
    fetch_config,
    redirect_headers,
)
from pagefleet.operator.handlers import KubeClient
from pagefleet.operator.spec import SpecError, parse_spec

CAPACITY = {"modelConfig": HYBRID_27B, "gpu": "H100-80GB", "numParameters": 27e9, "overheadGB": 5}
ONE_GPU = {"resources": {"limits": {"nvidia.com/gpu": 1}}}


def _refuse_fetch(url: str, token: str | None) -> dict:
    raise AssertionError(f"fetched {url} with no need")


def _spec(engine_args: dict, capacity: dict | None = None, pool: dict | None = None, **spec):
    raw = model_deployment(
        engineArgs=engine_args,
        pools={"colocated": pool or ONE_GPU},
        capacity=CAPACITY if capacity is None else capacity,
        **spec,
    )
    return parse_spec(raw["spec"])


def _verdict(spec, configs: ModelConfigs | None = None, token: str | None = None):
    return check_capacity(spec, configs or ModelConfigs(fetch=_refuse_fetch), lambda: token)


def test_a_pool_too_small_for_max_model_len_is_refused_with_numbers_and_knobs():
    verdict = _verdict(_spec({"max-model-len": 262144}))
    assert (verdict.status, verdict.reason, verdict.refused) == ("False", "PoolTooSmall", True)
    message = verdict.message
    assert "pool colocated" in message
    assert "222,768 tokens" in message and "14.6 GB" in message  # the published figures
    for knob in (
        "max-model-len <= 222,768",
        "kv-cache-dtype fp8 (445,552 tokens)",
        "tensor-parallel-size",
        "admitAnyway",
    ):
        assert knob in message


def test_each_fix_the_message_names_is_admitted():
    two_gpus = {"tensorParallelSize": 2, "resources": {"limits": {"nvidia.com/gpu": 2}}}
    for args, pool in (
        ({"max-model-len": 32768}, None),
        ({"max-model-len": 262144, "kv-cache-dtype": "fp8"}, None),  # a 1-byte KV cache
        ({"max-model-len": 262144}, two_gpus),  # KV heads and weights split over 2 GPUs
    ):
        verdict = _verdict(_spec(args, pool=pool))
        assert (verdict.status, verdict.reason) == ("True", "CapacityOK"), verdict.message
    ok = _verdict(_spec({"max-model-len": 32768}))
    assert "6 requests of max-model-len 32,768" in ok.message


def test_a_hybrid_pools_state_slots_are_paid_before_its_kv_pool():
    """A pool that sets max-num-seqs pays the hybrid's state slots first, as the engine and
    `pagefleet plan --max-num-seqs` do: 8 sequences and 8 snapshots of 74.8 MiB leave 12,726
    of the published 13,923 blocks; 128 sequences' 256 slots (20 GB) leave none."""
    ok = _verdict(_spec({"max-model-len": 32768, "max-num-seqs": 8}))
    assert ok.reason == "CapacityOK" and "203,616 tokens" in ok.message
    full = _verdict(_spec({"max-model-len": 32768, "max-num-seqs": 128}))
    assert full.reason == "PoolTooSmall" and "holds 0 tokens" in full.message


def test_no_max_model_len_is_refused_unless_the_expert_overrides():
    verdict = _verdict(_spec({}))
    assert (verdict.reason, verdict.refused) == ("NoMaxModelLen", True)
    assert "262144 tokens" in verdict.message  # the model's native context
    # Refused even when the GPU and model are not known: no numbers then, still the fix.
    unknown = _verdict(_spec({}, capacity={}))
    assert unknown.reason == "NoMaxModelLen" and "engineArgs.max-model-len" in unknown.message
    anyway = _verdict(_spec({}, capacity={**CAPACITY, "admitAnyway": True}))
    assert (anyway.status, anyway.refused) == ("False", False)
    assert "deployed anyway" in anyway.message


def test_the_gpu_type_comes_from_the_pools_gpu_product_label():
    """GPU feature discovery's product names map to the table; an unknown one is a check that
    cannot run (deployed, with the fix), not a refusal."""
    shape_only = {k: v for k, v in CAPACITY.items() if k != "gpu"}
    labelled = {**ONE_GPU, "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}
    by_label = _verdict(_spec({"max-model-len": 262144}, shape_only, labelled))
    assert by_label.reason == "PoolTooSmall" and "222,768 tokens" in by_label.message
    l4 = {**ONE_GPU, "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"}}
    assert _verdict(_spec({"max-model-len": 8192}, shape_only, l4)).reason == "PoolTooSmall"
    odd = {**ONE_GPU, "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-Quadro-RTX-8000"}}
    unknown = _verdict(_spec({"max-model-len": 8192}, shape_only, odd))
    assert (unknown.status, unknown.refused) == ("Unknown", False)
    assert "gpuMemoryGB" in unknown.message
    # An L4 cannot even hold the bf16 weights: the fix is smaller weights, not a shorter context.
    l4_verdict = _verdict(_spec({"max-model-len": 8192}, shape_only, l4))
    assert "holds 0 tokens" in l4_verdict.message and "fp8, int4" in l4_verdict.message
    assert "max-model-len <=" not in l4_verdict.message
    nothing = _verdict(_spec({"max-model-len": 8192}, shape_only))
    assert nothing.status == "Unknown" and "nvidia.com/gpu.product" in nothing.message


def test_cpu_pools_are_not_checked_against_gpu_memory():
    cpu = {"resources": {"requests": {"cpu": "4"}}}
    assert _verdict(_spec({}, pool=cpu)) is None


def test_capacity_spec_errors_name_the_field():
    for bad, field in (
        ({"gpu": "TPU"}, "spec.capacity.gpu"),
        ({"modelConfig": {}}, "spec.capacity.modelConfig"),
        ({"overheadGB": -1}, "spec.capacity.overheadGB"),
        ({"weightsFormat": "int3"}, "spec.capacity.weightsFormat"),
        ({"typo": 1}, "unknown field"),
        # Valid JSON numbers whose sums overflowed a float (int(inf): an OverflowError out of
        # the handler instead of a spec error).
        ({"gpuMemoryGB": 1e300}, "spec.capacity.gpuMemoryGB"),
        ({"overheadGB": 1e300}, "spec.capacity.overheadGB"),
        ({"numParameters": 1.7e308, "weightsFormat": "fp32"}, "spec.capacity.numParameters"),
    ):
        with pytest.raises(SpecError, match=field):
            _verdict(_spec({"max-model-len": 8192}, {**CAPACITY, **bad}))
    for length in (0, "many"):
        with pytest.raises(SpecError, match="max-model-len"):
            _verdict(_spec({"max-model-len": length}))
    missing_shape = _verdict(_spec({"max-model-len": 8192}, {**CAPACITY, "modelConfig": None}))
    assert missing_shape.status == "Unknown" and "modelConfig" in missing_shape.message


def test_the_crd_schema_takes_spec_capacity():
    md = model_deployment(
        engineArgs={"max-model-len": 8192},
        pools={"colocated": ONE_GPU},
        capacity={**CAPACITY, "admitAnyway": True, "gpuMemoryGB": 96, "weightsFormat": "fp8"},
    )
    validate_model_deployment(md)


def test_the_chart_passes_modeldeployment_capacity_to_the_spec(helm, tmp_path):  # noqa: F811
    """The chart's default ModelDeployment (a GPU pool with max-model-len) with
    modelDeployment.capacity set: the operator checks it as given, and it fits."""
    values = tmp_path / "values.yaml"
    capacity = {"gpu": "L4", "modelConfig": QWEN_7B, "overheadGB": 1}
    values.write_text(json.dumps({"modelDeployment": {"capacity": capacity}}))
    md = one(template(helm, "-f", str(values)), "ModelDeployment")
    assert md["spec"]["capacity"] == capacity
    validate_model_deployment(md)
    verdict = _verdict(parse_spec(md["spec"]))
    assert (verdict.status, verdict.reason) == ("True", "CapacityOK"), verdict.message
    assert "max-model-len 8,192" in verdict.message


# --- an hf:// model's config.json, from the stand-in Hub ------------------------------------

SHAPE_ONLY = {"gpu": "H100-80GB", "numParameters": 27e9, "overheadGB": 5}


def _hf_spec(hub: HfStandIn, repo: str, engine_args: dict | None = None, **hf):
    model = {"name": "m", "uri": f"hf://{repo}", "hf": {"endpoint": hub.endpoint, **hf}}
    return _spec(engine_args or {"max-model-len": 262144}, SHAPE_ONLY, model=model)


def test_an_hf_models_shape_is_read_from_its_config_json_once():
    with HfStandIn() as hub:
        hub.add_repo("org/hybrid", {"config.json": json.dumps(HYBRID_27B).encode()})
        configs = ModelConfigs()
        spec = _hf_spec(hub, "org/hybrid")
        for _ in range(3):
            verdict = _verdict(spec, configs)
            assert verdict.reason == "PoolTooSmall" and "222,768 tokens" in verdict.message
        assert hub.gets("org/hybrid", "config.json") == 1


def test_a_gated_models_config_is_fetched_with_the_token():
    with HfStandIn() as hub:
        config = {"config.json": json.dumps(HYBRID_27B).encode()}
        hub.add_repo("org/gated", config, gated_tokens={"hf_granted"})
        secret = {"tokenSecret": {"name": "hf-token", "key": "token"}}
        spec = _hf_spec(hub, "org/gated", **secret)
        denied = _verdict(spec, ModelConfigs())
        assert (denied.status, denied.refused) == ("Unknown", False)
        assert "HTTP 401" in denied.message and "tokenSecret" in denied.message
        granted = _verdict(spec, ModelConfigs(), token="hf_granted")
        assert granted.reason == "PoolTooSmall"


def test_a_config_that_cannot_be_read_is_a_check_that_could_not_run():
    """Catches the operator crashing (or hanging) on an endpoint that is down, a body that is
    not JSON or one far larger than a config: the condition says why, the pool deploys."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with HfStandIn() as hub:
        hub.add_repo("org/text", {"config.json": b"<html>not json</html>"})
        hub.add_repo("org/huge", {"config.json": b"{" + b" " * (MAX_CONFIG_BYTES + 1) + b"}"})
        for spec, why in (
            (_hf_spec(hub, "org/text"), "is not JSON"),
            (_hf_spec(hub, "org/huge"), "larger than"),
            (_hf_spec(hub, "org/absent"), "HTTP 401"),
        ):
            verdict = _verdict(spec, ModelConfigs())
            assert (verdict.status, verdict.reason) == ("Unknown", "CapacityUnknown")
            assert why in verdict.message and not verdict.refused
    model = {"name": "m", "uri": "hf://org/x", "hf": {"endpoint": f"http://127.0.0.1:{port}"}}
    down = _spec({"max-model-len": 8192}, SHAPE_ONLY, model=model)
    configs = ModelConfigs()
    verdict = _verdict(down, configs)
    assert verdict.status == "Unknown" and "could not be fetched" in verdict.message
    assert len(configs.failed) == 1  # remembered: the next pass does not wait on it again
    # Without max-model-len the pool is refused all the same.
    assert _verdict(_spec({}, SHAPE_ONLY, model=model), configs).reason == "NoMaxModelLen"


# --- a hostile endpoint -------------------------------------------------------------------


class HostileEndpoint:
    """A raw HTTP server (127.0.0.1) whose answer per path is a script: a function given the
    connected socket. It records each request's head, so a test can tell what was sent where."""

    def __init__(self, routes: dict) -> None:
        self.routes = routes
        self.heads: list[str] = []
        self.stop = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def __enter__(self) -> HostileEndpoint:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)  # wakes accept(), which close() does not
        self.server.close()
        self.thread.join(timeout=10)

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 65536:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                head += chunk
            text = head.decode(errors="replace")
            self.heads.append(text)
            path = text.split(" ", 2)[1]
            with contextlib.suppress(OSError):  # the client went away, as a fetch giving up
                self.routes[path.split("?")[0]](conn, self)


def _reply(status: str, body: bytes = b"", headers: str = "") -> Callable:
    def answer(conn: socket.socket, _: HostileEndpoint) -> None:
        conn.sendall(
            f"HTTP/1.1 {status}\r\n{headers}Content-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + body
        )

    return answer


def _trickle(head: bytes) -> Callable:
    """Sends `head`, then one byte every 0.1 s until the test ends: every recv comes well
    within a socket timeout, so only an overall deadline ends the fetch."""

    def answer(conn: socket.socket, server: HostileEndpoint) -> None:
        conn.sendall(head)
        while not server.stop.wait(0.1):
            conn.sendall(b" ")

    return answer


def _fetch_outcome(url: str, token: str | None = None, timeout_s: float = 1.0):
    """fetch_config's result or exception, waiting for it with a generous deadline in a
    thread (a fetch that hangs fails the test instead of hanging it)."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(fetch_config(url, token, timeout_s=timeout_s))
        except Exception as e:  # the test inspects what came out
            outcome.append(e)

    threading.Thread(target=run, daemon=True).start()
    return wait_for(lambda: outcome, timeout=30 + timeout_s, what=f"fetch of {url}")[0]


def test_a_trickling_endpoint_cannot_hold_the_fetch_past_its_deadline():
    """Catches a slow-loris endpoint hanging the reconcile: a socket timeout bounds each recv,
    not the fetch, so headers or a body trickled a byte at a time held it for days."""
    slow_body = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n{"
    with HostileEndpoint({"/body": _trickle(slow_body), "/head": _trickle(b"HTTP/1.1 200")}) as e:
        for path in ("/body", "/head"):
            outcome = _fetch_outcome(e.url(path), timeout_s=1.0)
            assert isinstance(outcome, CapacityUnknown), outcome
            assert "took more than 1 s" in str(outcome)


def test_a_hostile_answer_is_a_check_that_could_not_run_and_echoes_nothing():
    """Catches a malformed status line (http.client's BadStatusLine, not an OSError) and JSON
    nested past the parser's recursion limit escaping the handler as exceptions (a crashed
    reconcile, the server's text in the operator's log), and any body reaching the message."""
    routes = {
        "/status": lambda conn, _: conn.sendall(b"SECRET-STATUS-LINE\r\n\r\n"),
        "/deep": _reply("200 OK", b"[" * 200_000),
        "/error": _reply("500 Internal Server Error", b"SECRET-BODY"),
        "/short": lambda conn, _: conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n{"),
    }
    with HostileEndpoint(routes) as e:
        for path in routes:
            outcome = _fetch_outcome(e.url(path))
            assert isinstance(outcome, CapacityUnknown), (path, outcome)
            assert "SECRET" not in str(outcome), str(outcome)


def test_redirects_are_bounded_http_only_and_keep_the_token_to_its_origin():
    """Catches the token following a redirect to another origin (here localhost vs
    127.0.0.1: another host to the client), a redirect to ftp:// being followed (urllib's
    redirect handler allows ftp, an SSRF to any host's FTP port) or to file://, and a redirect
    loop going on unbounded; a redirect's body is never read (urllib reads it whole)."""
    config = json.dumps(QWEN_7B).encode()
    with socket.create_server(("127.0.0.1", 0)) as ftp:
        ftp.settimeout(0.2)
        routes = {
            "/config": _reply("200 OK", config),
            "/ftp": _reply(
                "302 Found", headers=f"Location: ftp://127.0.0.1:{ftp.getsockname()[1]}/x\r\n"
            ),
            "/file": _reply("302 Found", headers="Location: file:///etc/passwd\r\n"),
            "/loop": _reply("302 Found", headers="Location: /loop\r\n"),
        }
        with HostileEndpoint(routes) as e:
            routes["/away"] = _reply(
                "307 Temporary", headers=f"Location: {e.url('/config', 'localhost')}\r\n"
            )
            assert _fetch_outcome(e.url("/away"), token="hf_secret") == QWEN_7B
            to_origin, to_other = e.heads
            assert "hf_secret" in to_origin and "hf_secret" not in to_other
            assert "localhost" in to_other
            for path in ("/ftp", "/file"):
                outcome = _fetch_outcome(e.url(path))
                assert isinstance(outcome, CapacityUnknown) and "redirect" in str(outcome), outcome
            with pytest.raises(TimeoutError):
                ftp.accept()  # nothing connected to the FTP port
            e.heads.clear()
            outcome = _fetch_outcome(e.url("/loop"))
            assert isinstance(outcome, CapacityUnknown) and "redirect" in str(outcome)
            assert len(e.heads) <= 1 + MAX_REDIRECTS


def test_a_token_that_is_no_header_value_is_not_echoed():
    """Catches a token Secret holding a line break (a file of two lines) putting the token
    into the condition: http.client refuses the header with a ValueError naming its value."""
    with HostileEndpoint({"/config": _reply("200 OK", b"{}")}) as e:
        outcome = _fetch_outcome(e.url("/config"), token="hf_secret\r\nX-Injected: 1")
    assert isinstance(outcome, CapacityUnknown), outcome
    assert "hf_secret" not in str(outcome) and "token" in str(outcome)


def test_a_token_is_not_sent_over_plain_http_after_a_redirect_from_https():
    """Catches a same-host https -> http redirect carrying the token in clear text."""
    assert redirect_headers("https://hub.example/a", "http://hub.example/b", "t") == {}
    assert redirect_headers("https://hub.example/a", "https://hub.example/b", "t") == {
        "Authorization": "Bearer t"
    }


HOSTILE_CONFIGS = (
    {**QWEN_7B, "num_hidden_layers": 10**12},
    {**QWEN_7B, "num_attention_heads": 0},
    {**QWEN_7B, "num_key_value_heads": -4},
    {**QWEN_7B, "head_dim": "128"},
    {**QWEN_7B, "max_position_embeddings": 1e300},
)


@pytest.mark.parametrize("config", HOSTILE_CONFIGS)
def test_a_hostile_model_config_is_a_bad_config_not_a_crash(config):
    """Catches spec.capacity.modelConfig (and a fetched config.json) with a huge, zero,
    negative or mistyped shape field crashing the handler (ZeroDivisionError), hanging it
    (10**12 layers) or admitting a nonsense pool: the condition says the config is bad."""
    capacity = {**CAPACITY, "modelConfig": config}
    verdict = _verdict(_spec({"max-model-len": 8192}, capacity))
    assert (verdict.status, verdict.reason, verdict.refused) == (
        "Unknown",
        "CapacityUnknown",
        False,
    )
    assert "config" in verdict.message and "must be a whole number" in verdict.message
    with HostileEndpoint(
        {"/org/m/resolve/main/config.json": _reply("200 OK", json.dumps(config).encode())}
    ) as e:
        model = {"name": "m", "uri": "hf://org/m", "hf": {"endpoint": e.url("")}}
        fetched = _verdict(_spec({"max-model-len": 8192}, SHAPE_ONLY, model=model), ModelConfigs())
        assert fetched.status == "Unknown" and "must be a whole number" in fetched.message


def test_the_config_cache_is_bounded():
    """Catches ModelConfigs keeping every config.json (up to 1 MB each) and every failure it
    ever saw: ModelDeployments naming ever new revisions or endpoints grew the operator's
    memory without bound."""

    def fetch(url: str, token: str | None) -> dict:
        if url.endswith("bad"):
            raise CapacityUnknown(f"{url} answered HTTP 404")
        return {"url": url}

    configs = ModelConfigs(fetch=fetch)
    for i in range(3 * MAX_CACHED_CONFIGS):
        assert configs.get(f"http://hub/{i}", None) == {"url": f"http://hub/{i}"}
        with pytest.raises(CapacityUnknown):
            configs.get(f"http://hub/{i}/bad", None)
    assert len(configs.found) <= MAX_CACHED_CONFIGS
    assert len(configs.failed) <= MAX_CACHED_CONFIGS
    last = f"http://hub/{3 * MAX_CACHED_CONFIGS - 1}"
    assert last in configs.found  # the newest are kept


# --- the operator ----------------------------------------------------------------------------


def _events(client: KubeClient) -> list[dict]:
    found = client.request("GET", KubeClient.path("v1", "Event", NS)) or {}
    return found.get("items", [])


def test_operator_refuses_before_any_object_and_deploys_once_fixed():
    """Catches a ModelDeployment whose pool cannot hold one request failing only at pod start:
    the operator applies nothing, says why in Degraded, CapacityAdmitted and a Warning event,
    and deploys once max-model-len fits."""
    with emulator() as url:
        client = KubeClient(url)
        with operator(url, client, autoscale_interval=0.3):
            md = model_deployment(
                engineArgs={"max-model-len": 262144},
                pools={"colocated": ONE_GPU},
                capacity=CAPACITY,
            )
            client.create(md)
            degraded = wait_degraded(client, "PoolTooSmall")
            assert "max-model-len <= 222,768" in degraded["message"]
            admitted = condition(md_status(client), "CapacityAdmitted")
            assert (admitted["status"], admitted["reason"]) == ("False", "PoolTooSmall")
            event = wait_for(lambda: [e for e in _events(client) if e["reason"] == "PoolTooSmall"])
            assert "kv-cache-dtype fp8" in event[0]["message"]
            assert get(client, "apps/v1", "Deployment", "llama-colocated") is None
            assert get(client, "v1", "Service", "llama-router") is None
            md = get(client, MD_API, "ModelDeployment", "llama")
            client.merge_patch(md, {"spec": {"engineArgs": {"max-model-len": 32768}}})
            wait_for(lambda: get(client, "apps/v1", "Deployment", "llama-colocated"))
            wait_for(
                lambda: condition(md_status(client), "Degraded").get("status") == "False",
                what="Degraded cleared",
            )
            admitted = condition(md_status(client), "CapacityAdmitted")
            assert (admitted["status"], admitted["reason"]) == ("True", "CapacityOK")


def test_operator_deploys_when_the_check_cannot_run_and_says_so():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    with emulator() as url:
        client = KubeClient(url)
        with operator(url, client, autoscale_interval=0.3):
            model = {"name": "m", "uri": "hf://org/m", "hf": {"endpoint": endpoint}}
            client.create(
                model_deployment(
                    model=model,
                    engineArgs={"max-model-len": 8192},
                    pools={"colocated": ONE_GPU},
                    capacity=SHAPE_ONLY,
                )
            )
            wait_for(lambda: get(client, "apps/v1", "Deployment", "llama-colocated"))
            admitted = wait_for(lambda: condition(md_status(client), "CapacityAdmitted"))
            assert (admitted["status"], admitted["reason"]) == ("Unknown", "CapacityUnknown")
            assert "could not be fetched" in admitted["message"]
            assert condition(md_status(client), "Degraded")["status"] == "False"


def test_operator_deploys_anyway_on_the_override_and_warns_once():
    with emulator() as url:
        client = KubeClient(url)
        with operator(url, client, autoscale_interval=0.3) as state:
            client.create(
                model_deployment(
                    engineArgs={"max-model-len": 262144},
                    pools={"colocated": ONE_GPU},
                    capacity={**CAPACITY, "admitAnyway": True},
                )
            )
            wait_for(lambda: get(client, "apps/v1", "Deployment", "llama-colocated"))
            admitted = wait_for(lambda: condition(md_status(client), "CapacityAdmitted"))
            assert (admitted["status"], admitted["reason"]) == ("False", "PoolTooSmall")
            assert "deployed anyway" in admitted["message"]
            wait_for(lambda: [e for e in _events(client) if e["reason"] == "PoolTooSmall"])
            next_pass(state)
            assert len([e for e in _events(client) if e["reason"] == "PoolTooSmall"]) == 1
            assert condition(md_status(client), "Degraded")["status"] == "False"


def test_admission_weighs_the_checkpoints_own_quantization():
    """A GPTQ config.json plans int4 weights, as the engine will load them (not bf16); an
    engine told --quantization fp8 on a float checkpoint plans fp8; weightsFormat still wins."""
    gptq = {**HYBRID_27B, "quantization_config": {"quant_method": "gptq", "bits": 4}}
    cases = [
        ({"modelConfig": gptq}, {}, "int4 weights 13.5 GB"),
        ({}, {"quantization": "fp8"}, "fp8 weights 27.0 GB"),
        ({}, {}, "bfloat16 weights 54.0 GB"),
        ({"modelConfig": gptq, "weightsFormat": "fp8"}, {}, "fp8 weights 27.0 GB"),
    ]
    for capacity, args, figure in cases:
        spec = _spec({"max-model-len": 8192, **args}, {**CAPACITY, **capacity})
        verdict = _verdict(spec)
        assert figure in verdict.message, (capacity, args, verdict.message)
