"""The ``latency`` policy's compiled scan (router/native/latency.c) against the pure-Python
score loop: for random fleets, matches in every tier, loads with and without fitted
latency lines, recent offered load, engine reports, backlogs, transfers, sessions and
configurations, the same chosen engine, reason, numbers and every candidate's ``Score``,
bit for bit; ties broken the same way.

The compiled helper is built by ``make venv``; where it is not, the pure path is the
only one and this module has nothing to compare."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config import PolicyConfig
from router.fleet.latency import LatencyModel, LatencyPriors
from router.fleet.load import EngineLoad
from router.index.base import Match
from router.policy import latency
from router.policy.base import LazyScores, RouteRequest
from router.policy.latency import LatencyPolicy
from router.policy.latency_config import LatencyPolicyConfig
from router.sessions import session_key
from router.types import EngineKey

pytestmark = pytest.mark.skipif(latency._SCAN is None, reason="the compiled helper is not built")

ENGINES = [EngineKey(f"10.0.0.{i}:8000", i % 2) for i in range(12)]
NOW = 100.0


@st.composite
def _match(draw: st.DrawFn) -> Match:
    blocks = draw(st.integers(1, 600))
    offloaded = draw(st.integers(0, blocks))
    return Match(blocks, offloaded, draw(st.integers(0, offloaded)))


@st.composite
def _load(draw: st.DrawFn) -> EngineLoad:
    reported = draw(st.booleans())
    waiting = st.one_of(st.none(), st.integers(0, 9), st.floats(0, 50))
    load = EngineLoad(
        requests=draw(st.integers(0, 30)),
        prefill_tokens=draw(st.sampled_from([0, 16, 1000, 12_345, 2**40])),
        decoding=draw(st.integers(0, 30)),
        decode_blocks=draw(st.integers(0, 5_000)),
        waiting=draw(waiting) if reported else None,
        running=draw(st.one_of(st.none(), st.floats(0, 300))) if reported else None,
        kv_usage=draw(st.one_of(st.none(), st.floats(0, 1))) if reported else None,
        reported_at=draw(st.sampled_from([None, 90.0, 99.5, 100.0])),
        routed=draw(st.integers(0, 3)),
        offered=draw(st.sampled_from([0.0, 10.0, 5_000.0, 40_000.0, 1e9])),
        offered_at=draw(st.sampled_from([NOW, NOW - 0.5, NOW - 3.0, NOW + 1.0])),
        replicas=draw(st.integers(1, 3)),
        peer_prefill_tokens=draw(st.sampled_from([0, 500])),
        backlog_until=draw(st.sampled_from([0.0, NOW - 1.0, NOW + 0.25])),
        output_tokens=draw(st.sampled_from([math.inf, 12.5, 3_000.0])),
    )
    if draw(st.booleans()):  # timed: a fitted line of its own
        fit = LatencyModel(LatencyPriors()).of(EngineKey("x:1"))
        speed = draw(st.sampled_from([20e-6, 50e-6, 55e-6, 200e-6]))
        for i in range(draw(st.integers(1, 40))):
            fit.observe_ttft(float(i), 300.0 * i, 0.01 + speed * 300 * i)
            fit.observe_tpot(float(i), 1.0 + i % 7, 0.008 + 0.0002 * (i % 7))
        load.latency = fit
    return load


_CONFIGS = st.builds(
    PolicyConfig,
    name=st.just("latency"),
    queue_weight=st.sampled_from([1.0, 0.5, 1.3]),
    prefill_weight=st.sampled_from([2.0, 1.0, 0.7, 3.0]),
    offload_weight=st.sampled_from([0.5, 0.8, 1.0]),
    disk_weight=st.sampled_from([None, 0.25, 0.0]),
    waiting_weight=st.sampled_from([0.0, 2.0]),
    running_weight=st.sampled_from([0.0, 0.3]),
    kv_usage_weight=st.sampled_from([0.0, 7.0]),
    report_max_age_s=st.sampled_from([5.0, 20.0]),
    latency=st.builds(
        LatencyPolicyConfig,
        itl_weight=st.sampled_from([1.0, 0.0, 0.05, 3.0]),
        harm_counts=st.sampled_from(["requests", "decoding"]),
        queue_model=st.sampled_from(["tokens", "backlog"]),
        idle_prefill_weight=st.sampled_from([None, 0.0, 1.0]),
        slowdown_weight=st.sampled_from([0.1, 0.0, 2.0]),
        speed_tolerance=st.sampled_from([1.0, 0.1, 0.0]),
        session_bonus_ms=st.sampled_from([5.0, 0.0, 500.0]),
        session_max_wait_ms=st.sampled_from([1000.0, 0.0, 50.0]),
    ),
)


@settings(max_examples=400, deadline=None)
@given(
    _CONFIGS,
    st.lists(st.sampled_from(ENGINES), min_size=1, max_size=12, unique=True),
    st.dictionaries(st.sampled_from(ENGINES), _match(), max_size=12),
    st.dictionaries(st.sampled_from(ENGINES), _load(), max_size=12),
    st.one_of(st.none(), st.dictionaries(st.sampled_from(ENGINES), st.floats(0, 1e5), max_size=6)),
    st.sampled_from([None, 2e-6]),
    st.integers(1, 9_000),
    st.sampled_from([1, 16, 64]),
    st.integers(0, 4_096),
    st.one_of(st.none(), st.sampled_from(ENGINES)),
)
def test_the_scan_chooses_and_scores_as_the_pure_loop(
    config: PolicyConfig,
    candidates: list[EngineKey],
    matches: dict[EngineKey, Match],
    loads: dict[EngineKey, EngineLoad],
    transfers: dict[EngineKey, float] | None,
    transfer_s_per_token: float | None,
    prompt_tokens: int,
    block_size: int,
    max_tokens: int,
    served: EngineKey | None,
) -> None:
    def policy() -> LatencyPolicy:
        made = LatencyPolicy(config, clock=lambda: NOW)
        if served is not None:  # the session's previous turn went there
            made.sessions.note(session_key("s"), served, NOW)
        return made

    request = RouteRequest(
        "r-1",
        [],
        prompt_tokens,
        block_size,
        max_tokens,
        session="s",
        transfer_tokens=transfers,
        transfer_s_per_token=transfer_s_per_token,
    )
    fast = policy().choose(request, candidates, matches, loads)
    scan, latency._SCAN = latency._SCAN, None
    try:
        slow = policy().choose(request, candidates, matches, loads)
    finally:
        latency._SCAN = scan
    assert isinstance(fast.scores, LazyScores) and isinstance(slow.scores, list)
    assert (fast.engine, fast.reason, fast.matched_blocks, fast.cached_tokens) == (
        slow.engine,
        slow.reason,
        slow.matched_blocks,
        slow.cached_tokens,
    )
    assert fast.chosen_score == slow.chosen_score
    assert list(fast.scores) == slow.scores
    assert fast.summary() == slow.summary() and fast.describe() == slow.describe()


def test_scores_are_made_only_when_read() -> None:
    policy = LatencyPolicy(PolicyConfig(name="latency"), clock=lambda: 0.0)
    engines = [EngineKey(f"10.1.0.{i}:8000") for i in range(1_000)]
    loads = {e: EngineLoad(prefill_tokens=10_000 * i) for i, e in enumerate(engines)}
    decision = policy.choose(RouteRequest("r", [], 4096, 16), engines, {}, loads)
    assert decision.engine == engines[0] and decision.reason == "no_prefix"
    assert decision.scores._items is None  # type: ignore[attr-defined]  # nothing made yet
    assert len(decision.scores) == 1_000
    assert decision.scores[999].queue == pytest.approx(50e-6 * 10_000 * 999)  # prior speed
    assert decision.scores._items is not None  # type: ignore[attr-defined]


def test_an_slo_takes_the_pure_loop() -> None:
    """The scan has no SLO filter: a request with one is scored by the Python loop."""
    policy = LatencyPolicy(PolicyConfig(name="latency"), clock=lambda: 0.0)
    engines = [EngineKey("10.2.0.1:8000"), EngineKey("10.2.0.2:8000")]
    loads = {engines[0]: EngineLoad(prefill_tokens=500)}
    request = RouteRequest("r", [], 4096, 16, slo_ttft_s=1.0)
    decision = policy.choose(request, engines, {}, loads)
    assert isinstance(decision.scores, list) and decision.engine == engines[1]
    assert policy.slo_checked == 1
