"""The router tokenizes and hashes prompts exactly as engines do, reusing earlier work; its
load view treats stale pods as unknown and restarted pods as empty."""

from __future__ import annotations

import asyncio
import random

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from pagefleet.common.block_hash import hash_blocks
from pagefleet.common.kv_events import BlockStored
from pagefleet.common.tokenizer import load_tokenizer
from pagefleet.router.core import Router, RouterConfig
from pagefleet.router.pods import PodRegistry
from pagefleet.router.prefix_index import PrefixIndex
from pagefleet.router.prompt_cache import PromptCache
from pagefleet.router.scoring import Pipeline, Pod

WORDS = ["cache", "block", "  token", "page,", "pool.", "\n\nmodel", "naïve", "東京", "x**2", "\t"]


def test_cached_tokenization_equals_full_tokenization_across_a_conversation(tiny_checkpoints):
    tok = load_tokenizer(tiny_checkpoints["llama"])
    cache = PromptCache(tok, chunk_chars=64)
    assert cache.enabled
    rng = random.Random(0)
    system = " ".join(rng.choice(WORDS) for _ in range(300))
    history = [{"role": "system", "content": system}]
    for turn in range(6):
        history.append({"role": "user", "content": " ".join(rng.sample(WORDS, 6)) + f" {turn}?"})
        text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        expected = tok.apply_chat_template(history, tokenize=True, add_generation_prompt=True)
        expected = list(expected if isinstance(expected, list) else expected["input_ids"])
        tokens, hashes = cache.encode(text, False, 16)
        assert list(tokens) == expected
        assert hashes == hash_blocks(expected, 16)
        history.append({"role": "assistant", "content": " ".join(rng.sample(WORDS, 5))})
    assert cache.hits >= 5  # every turn after the first reused the earlier ones


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.sampled_from([*WORDS, " ", "  ", "!", "a", "ok "]), min_size=0, max_size=120),
    st.lists(st.sampled_from([*WORDS, " ", "?"]), min_size=0, max_size=30),
    st.sampled_from([8, 16]),
)
def test_any_text_sharing_a_prefix_tokenizes_exactly(tiny_checkpoints, head, tail, block_size):
    tok = load_tokenizer(tiny_checkpoints["llama"])
    cache = PromptCache(tok, chunk_chars=16)
    first = "".join(head)
    cache.encode(first, True, block_size)
    second = first + "".join(tail)
    full = tok.encode(second)
    tokens, hashes = cache.encode(second, True, block_size)
    assert (list(tokens), hashes) == (full, hash_blocks(full, block_size))


class _Spaceless:
    """A tokenizer whose tokens cross whitespace: the cache must notice and turn itself off."""

    class backend_tokenizer:
        @staticmethod
        def encode(text, add_special_tokens=True):
            return type("E", (), {"ids": [len(text)]})()

        @classmethod
        def encode_batch(cls, texts, add_special_tokens=True):
            return [cls.encode(t) for t in texts]


def test_a_tokenizer_that_does_not_split_at_whitespace_turns_the_cache_off():
    cache = PromptCache(_Spaceless())
    assert not cache.enabled
    assert list(cache.encode("a b " * 100, True, 1)[0]) == [400]


def _router(tok, pods: list[Pod]) -> Router:
    registry = PodRegistry()
    registry.set_pods(pods)
    for status in registry.status.values():
        status.ready = True  # as after a good scrape
    return Router(registry, PrefixIndex("precise"), Pipeline.from_config(), RouterConfig(), tok)


def test_router_hashes_chats_as_the_engine_renders_them(tiny_checkpoints):
    """add_generation_prompt changes the tokens; the router must follow the request's value."""
    tok = load_tokenizer(tiny_checkpoints["llama"])
    router = _router(tok, [Pod("a", "http://a")])
    messages = [{"role": "user", "content": "hello " * 40}]
    for add in (True, False):
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add)
        ids = list(ids if isinstance(ids, list) else ids["input_ids"])
        body = {"messages": messages, "add_generation_prompt": add}
        assert router.prompt_hashes("/v1/chat/completions", body, 4) == hash_blocks(ids, 4)


def test_router_hashes_the_tools_a_chat_template_renders(tiny_checkpoints):
    """Templates render the request's tools ahead of the messages: requests with the same tools
    share their leading blocks (and match the engine's rendering); other tools, other blocks."""
    tok = load_tokenizer(tiny_checkpoints["llama"])
    tok.chat_template = (
        "{% if tools %}{% for t in tools %}tool {{ t.function.name }}: "
        "{{ t.function.description }}\n{% endfor %}{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    router = _router(tok, [Pod("a", "http://a")])

    def tools(name: str) -> list[dict]:
        return [{"type": "function", "function": {"name": name, "description": "look " * 40}}]

    def hashes(tool_name: str, question: str) -> list:
        body = {"messages": [{"role": "user", "content": question}], "tools": tools(tool_name)}
        return router.prompt_hashes("/v1/chat/completions", body, 4)

    weather, other_question, search = (
        hashes("weather", "rain today?"),
        hashes("weather", "snow tomorrow?"),
        hashes("search", "rain today?"),
    )
    messages = [{"role": "user", "content": "rain today?"}]
    ids = tok.apply_chat_template(messages, tools=tools("weather"), tokenize=True)
    assert weather == hash_blocks(list(ids if isinstance(ids, list) else ids["input_ids"]), 4)
    assert len(weather) > 10 and weather[:10] == other_question[:10]
    assert weather[0] != search[0]


def test_pods_with_another_block_size_are_matched_on_their_own_hashes(tiny_checkpoints):
    tok = load_tokenizer(tiny_checkpoints["llama"])
    router = _router(tok, [Pod("b8", "http://b8"), Pod("b16", "http://b16")])
    router.registry.status["b8"].block_size = 8
    body = {"model": "m", "prompt": "the same long prompt " * 20}
    ids = tok.encode(body["prompt"])
    router.index.apply("b8", [BlockStored(hash_blocks(ids, 8), None, [], 8)])
    router.index.apply("b16", [BlockStored(hash_blocks(ids, 16)[:2], None, [], 16)])
    routed = router.decide("/v1/completions", body)
    assert set(routed.hashes) == {8, 16}
    assert routed.routing.prefix_matches == {"b8": len(ids) // 8, "b16": 4}  # 8-token blocks
    assert routed.candidates[0].pod.name == "b8"


def test_stale_load_reads_as_the_fleet_mean_not_as_idle():
    registry = PodRegistry(stale_after=2.0)
    registry.set_pods([Pod("a", "http://a"), Pod("b", "http://b"), Pod("c", "http://c")])
    for name, waiting in (("a", 2.0), ("b", 6.0), ("c", 50.0)):
        registry.status[name].pod.waiting = waiting
        registry.status[name].scraped_at = 100.0
    registry.status["c"].scraped_at = 90.0  # silent for 10 s
    pods = {p.name: p for p in registry.pods(now=100.5)}
    assert pods["c"].waiting == 4.0 and pods["a"].waiting == 2.0


def test_a_slow_scrape_interval_keeps_load_fresh_between_its_scrapes():
    """A picker scraping every 5 s read the pods' loads as the fleet's mean for 3 s of every 5
    (stale after 2 s): two pods of different load tied, and the pick fell to a tie-break."""
    registry = PodRegistry(interval=5.0)
    registry.set_pods([Pod("idle", "http://a"), Pod("busy", "http://b")])
    registry.status["busy"].pod.waiting = 3.0
    for status in registry.status.values():
        status.scraped_at = 100.0
    pods = {p.name: p.waiting for p in registry.pods(now=104.9)}  # just before the next scrape
    assert pods == {"idle": 0.0, "busy": 3.0}
    registry.status["idle"].scraped_at = 110.0
    pods = {p.name: p.waiting for p in registry.pods(now=113.0)}
    assert pods == {"idle": 0.0, "busy": 0.0}  # busy missed two scrapes: the fleet's mean


def test_a_restarted_pod_is_purged_from_the_index_on_the_next_scrape():
    started = {"t": 1000.0}

    def handler(request: httpx.Request) -> httpx.Response:
        body = f"process_start_time_seconds {started['t']}\nvllm:num_requests_waiting 0\n"
        return httpx.Response(200, text=body)

    registry = PodRegistry()
    registry.set_pods([Pod("a", "http://a")])
    index = PrefixIndex("approximate")
    index.record("a", hash_blocks(list(range(64)), 16), now=0.0)
    registry.on_lost = index.remove_pod

    async def scrape_twice():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await registry._scrape(client, registry.status["a"])
            assert index.num_blocks("a") == 4  # same process: nothing forgotten
            started["t"] = 1234.5
            await registry._scrape(client, registry.status["a"])

    asyncio.run(scrape_twice())
    assert index.num_blocks("a") == 0
