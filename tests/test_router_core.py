"""The router's pure core: prefix index (precise, approximate, speculative) and the
filters -> scorers -> picker pipeline."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagefleet.block_hash import hash_blocks
from pagefleet.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pagefleet.router.prefix_index import PrefixIndex
from pagefleet.router.scoring import (
    ACTIVE_BLOCK_COST,
    DEFAULT_WEIGHTS,
    Pipeline,
    Pod,
    RoutingRequest,
)

H = hash_blocks(list(range(64)), 8)  # 8 chained block hashes


def stored(hashes):
    return BlockStored(list(hashes), None, [], 8)


def test_precise_index_follows_events_and_matches_leading_blocks():
    index = PrefixIndex("precise")
    index.apply("a", [stored(H[:6])])
    index.apply("b", [stored(H[:2])])
    assert index.match(H, now=0) == {"a": 6, "b": 2}
    index.apply("a", [BlockRemoved([H[3]])])  # a hole ends the prefix
    assert index.match(H, now=0) == {"a": 3, "b": 2}
    index.apply("b", [AllBlocksCleared()])
    assert index.match(H, now=0) == {"a": 3}
    index.remove_pod("a")
    assert index.match(H, now=0) == {} and index.pods() == set()


def test_a_block_held_out_of_order_does_not_count():
    index = PrefixIndex("precise")
    index.apply("a", [stored(H[1:4])])  # no first block: nothing usable
    assert index.match(H, now=0) == {}


def test_speculative_entries_route_bursts_until_events_or_ttl():
    index = PrefixIndex("precise", speculative_ttl=2.0)
    index.record("a", H[:4], now=10.0)
    assert index.match(H, now=11.0) == {"a": 4}
    assert index.match(H, now=12.5) == {}  # expired, no event confirmed it
    index.record("b", H[:4], now=20.0)
    index.apply("b", [stored(H[:2])])  # confirmed part outlives the TTL
    assert index.match(H, now=30.0) == {"b": 2}
    index.expire(now=30.0)
    assert "b" in index.pods()


def test_approximate_index_is_an_lru_per_pod():
    index = PrefixIndex("approximate")
    index.set_capacity("a", 4)
    index.record("a", H[:4], now=0)
    assert index.match(H, now=0) == {"a": 4}
    index.record("a", H[4:6], now=0)  # evicts the two least recently sent: H[0], H[1]
    assert index.num_blocks("a") == 4
    assert index.match(H, now=0) == {}
    assert index.match(H[2:], now=0) == {"a": 4}


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["store", "remove", "clear"]),
            st.sampled_from(["a", "b", "c"]),
            st.integers(0, 7),
            st.integers(1, 8),
        ),
        max_size=40,
    )
)
def test_match_equals_a_brute_force_longest_prefix(ops):
    index = PrefixIndex("precise")
    truth: dict[str, set] = {"a": set(), "b": set(), "c": set()}
    for op, pod, start, length in ops:
        hashes = H[start : start + length]
        if op == "store":
            index.apply(pod, [stored(hashes)])
            truth[pod].update(hashes)
        elif op == "remove":
            index.apply(pod, [BlockRemoved(list(hashes))])
            truth[pod].difference_update(hashes)
        else:
            index.apply(pod, [AllBlocksCleared()])
            truth[pod].clear()
    expected = {}
    for pod, held in truth.items():
        n = next((i for i, h in enumerate(H) if h not in held), len(H))
        if n:
            expected[pod] = n
    assert index.match(H, now=0) == expected


def pods() -> list[Pod]:
    return [
        Pod("a", "http://a", waiting=2, kv_usage=0.6, inflight=2, models=frozenset({"m"})),
        Pod("b", "http://b", waiting=0, kv_usage=0.2, inflight=0, models=frozenset({"m"})),
        Pod("c", "http://c", waiting=1, kv_usage=0.5, inflight=1, healthy=False),
        Pod("d", "http://d", models=frozenset({"other"})),
        Pod("p", "http://p", role="prefill"),
    ]


def test_filters_drop_unhealthy_other_models_and_roles():
    pipe = Pipeline.from_config()
    names = {p.name for p in pipe.candidates(RoutingRequest("m", H), pods())}
    assert names == {"a", "b"}
    prefill = {p.name for p in pipe.candidates(RoutingRequest("m", H, role="prefill"), pods())}
    assert prefill == {"a", "b", "p"}


def test_prefix_affinity_beats_load_with_default_weights_and_load_breaks_ties():
    pipe = Pipeline.from_config()
    rng = random.Random(0)
    warm = RoutingRequest("m", H, prefix_matches={"a": 8})
    decision = pipe.pick(warm, pods(), rng)
    assert decision.pod.name == "a"  # 3 x 1.0 prefix outweighs its somewhat heavier load
    swamped = [
        Pod("a", "http://a", waiting=40, kv_usage=1.0, inflight=30, models=frozenset({"m"})),
        *pods()[1:],
    ]
    assert pipe.pick(warm, swamped, rng).pod.name == "b"  # but not a swamped one
    assert decision.contributions["prefix"] == pytest.approx(3.0)
    cold = RoutingRequest("m", H)
    assert pipe.pick(cold, pods(), rng).pod.name == "b"  # least loaded
    assert set(decision.contributions) == set(DEFAULT_WEIGHTS)


def test_scores_are_in_unit_range_and_ties_are_broken_at_random():
    pipe = Pipeline.from_config({"scorers": {"queue": 1.0}})
    twins = [Pod("x", "http://x"), Pod("y", "http://y")]
    seen = {pipe.pick(RoutingRequest("m", H), twins, random.Random(s)).pod.name for s in range(20)}
    assert seen == {"x", "y"}
    for score, _, parts in Pipeline.from_config().rank(RoutingRequest("m", H), pods()):
        weights = DEFAULT_WEIGHTS
        assert all(0 <= parts[k] <= weights[k] for k in parts)
        assert score == pytest.approx(sum(parts.values()))


def test_no_candidate_gives_no_decision_and_bad_configs_are_refused():
    pipe = Pipeline.from_config()
    assert pipe.pick(RoutingRequest("unknown-model", H), pods()[3:4], random.Random(0)) is None
    with pytest.raises(ValueError, match="unknown plugins"):
        Pipeline.from_config({"scorers": {"magic": 1}})
    with pytest.raises(ValueError, match=">= 0"):
        Pipeline.from_config({"scorers": {"queue": -1}})
    with pytest.raises(ValueError, match="mode"):
        PrefixIndex("fuzzy")


def test_kv_cost_prefers_a_hit_until_the_pods_backlog_outweighs_prefilling_elsewhere():
    req = RoutingRequest("m", H, prefix_matches={"hot": len(H)})
    hot, cold = Pod("hot", "u"), Pod("cold", "u")
    pipeline = Pipeline(["healthy"], {"kv-cost": 1.0})
    rng = random.Random(0)
    assert pipeline.pick(req, [hot, cold], rng).pod.name == "hot"
    backlog = int((len(H) + 1) / ACTIVE_BLOCK_COST)  # in-flight work worth more than a prefill
    hot.begin(blocks=backlog)
    assert pipeline.pick(req, [hot, cold], rng).pod.name == "cold"
    hot.end(blocks=backlog)
    assert (hot.inflight, hot.active_blocks) == (0, 0)
    assert pipeline.pick(req, [hot, cold], rng).pod.name == "hot"


def test_disaggregate_only_when_enough_of_the_prompt_is_uncached_on_the_decode_pod():
    from pagefleet.router.pd import decode_body, prefill_body, should_disaggregate

    assert should_disaggregate(
        prompt_blocks=40, cached_blocks=8, block_size=16, threshold_tokens=512
    )
    assert not should_disaggregate(40, 9, 16, 512)  # 31 blocks = 496 tokens left
    body = {"prompt": "x", "max_tokens": 50, "stream": True, "n": 1, "max_completion_tokens": 9}
    p = prefill_body(body)
    assert (p["max_tokens"], p["max_completion_tokens"]) == (1, 1)
    assert "stream" not in p and p["kv_transfer_params"] == {"do_remote_decode": True}
    assert decode_body(body, {"a": 1})["kv_transfer_params"] == {"a": 1} and body["stream"]


def test_scores_have_their_documented_values():
    """Exact values, so a changed constant or default shows: load 1 / (1 + v / (mean + 1)),
    kv-usage clamped to [0, 1], prefix = matched / prompt blocks (0 when absent or empty),
    kv-cost (cheapest + 1) / (cost + 1)."""
    from pagefleet.router.scoring import (
        inflight_scorer,
        kv_cost_scorer,
        kv_usage_scorer,
        prefix_scorer,
        queue_scorer,
    )

    a, b = Pod("a", "u", waiting=3.0, inflight=1), Pod("b", "u", waiting=1.0, inflight=3)
    assert queue_scorer(RoutingRequest("m", H), [a, b]) == {
        "a": pytest.approx(1 / (1 + 3 / 3)),
        "b": pytest.approx(1 / (1 + 1 / 3)),
    }
    assert inflight_scorer(RoutingRequest("m", H), [a, b])["b"] == pytest.approx(1 / (1 + 1))
    odd = [Pod("low", "u", kv_usage=-0.5), Pod("high", "u", kv_usage=1.5)]
    assert kv_usage_scorer(RoutingRequest("m", H), odd) == {"low": 1.0, "high": 0.0}
    req = RoutingRequest("m", H, prefix_matches={"a": 2})
    assert prefix_scorer(req, [a, b]) == {"a": 2 / 8, "b": 0.0}
    assert prefix_scorer(RoutingRequest("m", []), [a]) == {"a": 0.0}
    b.active_blocks = 4
    # a: 8 - 2 = 6 blocks to prefill; b: 8 + 0.25 x 4 = 9.
    assert kv_cost_scorer(req, [a, b]) == {"a": 1.0, "b": pytest.approx(7 / 10)}
    assert kv_cost_scorer(req, []) == {}


def test_weights_zero_disables_a_scorer_and_any_weight_below_zero_is_refused():
    pipe = Pipeline(["healthy"], {"queue": 0, "prefix": 0.5})
    assert pipe.weights == {"prefix": 0.5}
    with pytest.raises(ValueError, match=r"^scorer weights must be >= 0$"):
        Pipeline(["healthy"], {"queue": -0.1})
    with pytest.raises(ValueError, match=r"unknown plugins \['nope', 'magic'\]"):
        Pipeline(["nope"], {"magic": 1})


def test_router_config_keys_are_checked_and_used():
    """Fails for: pd_threshold_tokens (read by the router) refused here, filters from the
    config ignored, a wrong type accepted because the other key is right."""
    assert Pipeline.from_config({"pd_threshold_tokens": 64}).weights == DEFAULT_WEIGHTS
    only_healthy = Pipeline.from_config({"filters": ["healthy"], "scorers": {"queue": 1}})
    assert len(only_healthy.filters) == 1
    other_model = [Pod("d", "http://d", models=frozenset({"other"}))]
    assert only_healthy.candidates(RoutingRequest("m", H), other_model) == other_model
    with pytest.raises(ValueError, match=r"unknown keys \['extra'\]; known: filters, scorers"):
        Pipeline.from_config({"extra": 1})
    for bad in ({"filters": "healthy"}, {"scorers": ["queue"]}):
        with pytest.raises(ValueError, match=r"^router config: filters must be a list, scorers"):
            Pipeline.from_config(bad)


def test_a_decision_reports_its_score_and_pods_count_what_they_are_sent():
    pipe = Pipeline(["healthy"], {"queue": 2.0})
    pod = Pod("a", "u", waiting=1.0)
    decision = pipe.pick(RoutingRequest("m", H), [pod], random.Random(0))
    assert decision.score == pytest.approx(2.0 / (1 + 1 / 2))
    pod.begin(blocks=3)
    pod.begin(blocks=4)
    assert (pod.inflight, pod.active_blocks) == (2, 7)
