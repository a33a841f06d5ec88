"""The router's error paths against scripted fake engines (tests/fake_engine.py), whose gauges
make the router's first pick deterministic: retry on a 5xx before the first byte, 502 when
every pod fails, no retry after the first byte, `--prefill-timeout`, `decode_only` (a short
prompt, and a long one whose blocks the decode pod already holds), and a prefill answer that
reaches the decode pod. Each test names the mutation of router/app.py or router/pd.py it
catches. The router runs with the fleet secret, as in a fleet (without it, it never
disaggregates)."""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest

from fake_engine import FakeEngine, Script, wait_scraped
from pagefleet.fleet_auth import SIGNATURE_HEADER, FieldSigner
from server_utils import FLEET_ENV, fleet_secret, metric_value, running_router

LONG = " ".join(f"word{i % 37} cache block" for i in range(60))  # ~ 1400 characters


@contextlib.contextmanager
def router_over(*pods: tuple[FakeEngine, str], flags: tuple[str, ...] = ()):
    """A real `pagefleet router` in front of the fakes (role suffix per pod), once it has read
    their gauges."""
    endpoints = ",".join(f"{fake.url}{'@' + role if role else ''}" for fake, role in pods)
    with running_router("--endpoints", endpoints, *flags, env=FLEET_ENV) as (router, _):
        wait_scraped(*(fake for fake, _ in pods))
        yield router


def complete(router: str, **body) -> httpx.Response:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, **body}
    return httpx.post(f"{router}/v1/completions", json=body, timeout=60)


@pytest.mark.parametrize("status", [500, 502, 503])
def test_a_5xx_before_the_first_byte_is_retried_on_the_next_pod(status):
    """The idle pod (ranked first) fails; the busier one answers. Fails for: the 5xx relayed to
    the client without a retry (the audit's mutation), or a retry on the same pod."""
    with (
        FakeEngine("idle", Script(status=status)) as failing,
        FakeEngine("busy", waiting=6.0, kv_usage=0.5) as healthy,
        router_over((failing, ""), (healthy, "")) as router,
    ):
        r = complete(router)
        assert r.status_code == 200, r.text
        assert r.json()["id"] == "busy"
        assert (len(failing.received), len(healthy.received)) == (1, 1)
        assert metric_value(router, "pagefleet_router:retries_total") == 1


def test_every_pod_failing_gives_502_after_one_attempt_each():
    """Fails for: the last 5xx relayed as is, attempts beyond the pods there are (the same pod
    twice), or --max-attempts ignored."""
    with (
        FakeEngine("a", Script(status=503)) as a,
        FakeEngine("b", Script(status=500), waiting=3.0) as b,
        router_over((a, ""), (b, "")) as router,
    ):
        r = complete(router)
        assert r.status_code == 502, r.text
        assert "no engine answered" in r.json()["error"]["message"]
        assert (len(a.received), len(b.received)) == (1, 1)
    with (
        FakeEngine("a", Script(status=503)) as a,
        FakeEngine("b", waiting=3.0) as b,
        router_over((a, ""), (b, ""), flags=("--max-attempts", "1")) as router,
    ):
        assert complete(router).status_code == 502
        assert (len(a.received), len(b.received)) == (1, 0)


def test_a_stream_cut_after_its_first_byte_ends_in_an_sse_error_not_a_retry():
    """Once bytes reached the client a retry would send a second answer: the client gets an
    SSE error event and [DONE]. Fails for: a retry after the first byte, or a stream that
    just stops (the client cannot tell it from a finished answer)."""
    with (
        FakeEngine("dies", Script(cut_stream_after_first_chunk=True)) as dies,
        FakeEngine("other", waiting=6.0) as other,
        router_over((dies, ""), (other, "")) as router,
    ):
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert json.loads(lines[0][6:])["id"] == "dies"
        assert json.loads(lines[-2][6:])["error"]["code"] == 502
        assert lines[-1] == "data: [DONE]"
        assert len(other.received) == 0


def prefill_params(fake: FakeEngine) -> dict:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": fake.name,
        "remote_host": "127.0.0.1",
        "remote_port": 1,  # nothing listens: the router's release (if any) fails quietly
        "remote_block_ids": [0, 1, 2],
        "remote_request_id": "held-1",
    }


def test_a_prefill_pod_slower_than_prefill_timeout_leaves_decode_to_prefill():
    """The prefill pod never answers; after --prefill-timeout the decode pod gets the original
    request. Fails for: --prefill-timeout not applied (the client waits for the 600 s read
    timeout: this test's 60 s client timeout fails first), or the decode pod sent stale
    kv_transfer_params."""
    with (
        FakeEngine("prefill", Script(hang=True)) as prefill,
        FakeEngine("decode") as decode,
        router_over(
            (prefill, "prefill"),
            (decode, "decode"),
            flags=("--pd-threshold-tokens", "0", "--prefill-timeout", "1"),
        ) as router,
    ):
        r = complete(router, prompt=LONG)
        assert r.status_code == 200, r.text
        (sent_to_prefill,) = prefill.received
        assert sent_to_prefill["kv_transfer_params"] == {"do_remote_decode": True}
        assert sent_to_prefill["max_tokens"] == 1
        assert_signed(prefill.received_headers[0], sent_to_prefill)
        (sent_to_decode,) = decode.received
        assert "kv_transfer_params" not in sent_to_decode
        assert sent_to_decode["max_tokens"] == 4
        outcome = {"outcome": "prefill_failed"}
        assert metric_value(router, "pagefleet_router:pd_decisions_total", outcome) == 1


def test_decode_only_for_short_prompts_and_for_prompts_the_decode_pod_holds():
    """A prompt under --pd-threshold-tokens, and a long prompt sent a second time (its blocks
    are now on the decode pod), go to the decode pod alone; the first long one goes through
    the prefill pod, whose kv_transfer_params reach the decode pod. Fails for: the decider
    ignoring the decode pod's cached blocks, the threshold compared the wrong way, or the
    prefill answer not handed to the decode pod."""
    with FakeEngine("prefill") as prefill, FakeEngine("decode") as decode:
        prefill.script.kv_transfer_params = prefill_params(prefill)
        flags = ("--pd-threshold-tokens", "200")  # tokens = characters / 4 without a tokenizer
        with router_over((prefill, "prefill"), (decode, "decode"), flags=flags) as router:
            assert complete(router, prompt="short prompt").status_code == 200
            assert len(prefill.received) == 0
            assert "kv_transfer_params" not in decode.received[-1]

            assert complete(router, prompt=LONG).status_code == 200
            assert len(prefill.received) == 1
            assert decode.received[-1]["kv_transfer_params"] == prefill_params(prefill)
            assert_signed(prefill.received_headers[-1], prefill.received[-1])
            assert_signed(decode.received_headers[-1], decode.received[-1])

            assert complete(router, prompt=LONG).status_code == 200
            assert len(prefill.received) == 1, "the decode pod held the prompt already"
            assert "kv_transfer_params" not in decode.received[-1]
            decisions = {
                outcome: metric_value(
                    router, "pagefleet_router:pd_decisions_total", {"outcome": outcome}
                )
                for outcome in ("decode_only", "disaggregated")
            }
            assert decisions == {"decode_only": 2, "disaggregated": 1}


def assert_signed(headers: dict, body: dict) -> None:
    """The router signed the body's kv_transfer_params for this request id (engines refuse
    them otherwise)."""
    signer = FieldSigner(fleet_secret())
    signature, request_id = headers.get(SIGNATURE_HEADER), headers.get("x-request-id", "")
    signer.verify(signature, request_id, body["kv_transfer_params"], time.time())
