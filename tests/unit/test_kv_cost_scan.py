"""``kv_cost``'s compiled scan (router/native/cost.c, issue 24) against the pure-Python
score loop: for random fleets, matches in every tier, loads with and without engine
reports, transfers and configurations, the same chosen engine, reason, numbers and
every candidate's ``Score``, bit for bit; ties broken the same way.

The compiled helper is built by ``make venv``; where it is not, the pure path is the
only one and this module has nothing to compare."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config import PolicyConfig
from router.fleet.load import EngineLoad
from router.index.base import Match
from router.policy import kv_cost
from router.policy.base import LazyScores, RouteRequest
from router.policy.kv_cost import KVCostPolicy
from router.types import EngineKey

pytestmark = pytest.mark.skipif(kv_cost._SCAN is None, reason="the compiled helper is not built")

ENGINES = [EngineKey(f"10.0.0.{i}:8000", i % 2) for i in range(12)]


@st.composite
def _match(draw: st.DrawFn) -> Match:
    blocks = draw(st.integers(1, 600))
    offloaded = draw(st.integers(0, blocks))
    return Match(blocks, offloaded, draw(st.integers(0, offloaded)))


@st.composite
def _load(draw: st.DrawFn) -> EngineLoad:
    reported = draw(st.booleans())
    waiting = st.one_of(st.none(), st.integers(0, 9), st.floats(0, 50))
    return EngineLoad(
        requests=draw(st.integers(0, 3)),
        prefill_tokens=draw(st.sampled_from([0, 16, 1000, 12_345, 2**40])),
        decode_blocks=draw(st.integers(0, 5_000)),
        waiting=draw(waiting) if reported else None,
        running=draw(st.one_of(st.none(), st.floats(0, 300))) if reported else None,
        kv_usage=draw(st.one_of(st.none(), st.floats(0, 1))) if reported else None,
        reported_at=draw(st.sampled_from([None, 90.0, 99.5, 100.0])),
        routed=draw(st.integers(0, 3)),
    )


_CONFIGS = st.builds(
    PolicyConfig,
    queue_weight=st.sampled_from([1.0, 0.5, 1.3]),
    prefill_weight=st.sampled_from([2.0, 1.0, 0.7]),
    decode_weight=st.sampled_from([0.25, 1.0, 0.1]),
    offload_weight=st.sampled_from([0.5, 0.8, 1.0]),
    disk_weight=st.sampled_from([None, 0.25, 0.0]),
    waiting_weight=st.sampled_from([0.0, 2.0]),
    running_weight=st.sampled_from([0.0, 0.3]),
    kv_usage_weight=st.sampled_from([0.0, 7.0]),
    report_max_age_s=st.sampled_from([5.0, 20.0]),
)


@settings(max_examples=400, deadline=None)
@given(
    _CONFIGS,
    st.lists(st.sampled_from(ENGINES), min_size=1, max_size=12),
    st.dictionaries(st.sampled_from(ENGINES), _match(), max_size=12),
    st.dictionaries(st.sampled_from(ENGINES), _load(), max_size=12),
    st.one_of(st.none(), st.dictionaries(st.sampled_from(ENGINES), st.floats(0, 1e5), max_size=6)),
    st.integers(1, 9_000),
    st.sampled_from([1, 16, 64]),
)
def test_the_scan_chooses_and_scores_as_the_pure_loop(
    config: PolicyConfig,
    candidates: list[EngineKey],
    matches: dict[EngineKey, Match],
    loads: dict[EngineKey, EngineLoad],
    transfers: dict[EngineKey, float] | None,
    prompt_tokens: int,
    block_size: int,
) -> None:
    policy = KVCostPolicy(config, clock=lambda: 100.0)
    request = RouteRequest("r-1", [], prompt_tokens, block_size, 64, transfer_tokens=transfers)
    fast = policy.choose(request, candidates, matches, loads)
    scan, kv_cost._SCAN = kv_cost._SCAN, None
    try:
        slow = policy.choose(request, candidates, matches, loads)
    finally:
        kv_cost._SCAN = scan
    assert isinstance(fast.scores, LazyScores) and isinstance(slow.scores, list)
    assert (fast.engine, fast.reason, fast.matched_blocks, fast.cached_tokens) == (
        slow.engine,
        slow.reason,
        slow.matched_blocks,
        slow.cached_tokens,
    )
    assert fast.chosen_score == slow.chosen_score
    assert len(fast.scores) == len(slow.scores)
    assert list(fast.scores) == slow.scores and fast.scores == slow.scores
    assert fast.summary() == slow.summary() and fast.describe() == slow.describe()


def test_scores_are_made_only_when_read() -> None:
    policy = KVCostPolicy(PolicyConfig(), clock=lambda: 0.0)
    engines = [EngineKey(f"10.1.0.{i}:8000") for i in range(1_000)]
    loads = {e: EngineLoad(prefill_tokens=100 * i) for i, e in enumerate(engines)}
    decision = policy.choose(RouteRequest("r", [], 4096, 16), engines, {}, loads)
    assert decision.engine == engines[0] and decision.reason == "no_prefix"
    assert decision.scores._items is None  # type: ignore[attr-defined]  # nothing made yet
    assert len(decision.scores) == 1_000
    assert decision.scores[999].queue == 100 * 999 / 16  # queue_weight 1 per block of 16
    assert decision.scores._items is not None  # type: ignore[attr-defined]


def test_a_mapping_that_is_not_a_dict_takes_the_pure_loop() -> None:
    """The scan reads dicts; any other load view is scored by the Python loop."""
    from types import MappingProxyType

    policy = KVCostPolicy(PolicyConfig(), clock=lambda: 0.0)
    engines = [EngineKey("10.2.0.1:8000"), EngineKey("10.2.0.2:8000")]
    loads = MappingProxyType({engines[0]: EngineLoad(prefill_tokens=500)})
    decision = policy.choose(RouteRequest("r", [], 4096, 16), engines, {}, loads)
    assert isinstance(decision.scores, list) and decision.engine == engines[1]
