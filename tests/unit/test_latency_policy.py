"""The ``latency`` policy: predicted TTFT, decode harm, SLOs and session affinity."""

from __future__ import annotations

import math

import pytest

from router.config import PolicyConfig
from router.core import RoutingCore
from router.fleet.latency import LatencyModel, LatencyPriors
from router.fleet.load import EngineLoad, LoadTracker
from router.index.base import Match
from router.index.memory import MemoryIndex
from router.policy import make_policy
from router.policy.base import RouteRequest
from router.policy.kv_cost import KVCostPolicy
from router.policy.latency import LatencyPolicy, priors_of
from router.policy.latency_config import LatencyPolicyConfig, SLOConfig
from router.sessions import MAX_KEY_CHARS, session_key
from router.types import EngineKey

ENGINES = [EngineKey(f"127.0.0.1:{8000 + i}") for i in range(3)]
A, B, C = ENGINES


def req(rid: str = "r1", prompt_tokens: int = 8000, **kw: object) -> RouteRequest:
    return RouteRequest(rid, list(range(prompt_tokens // 16)), prompt_tokens, 16, **kw)  # type: ignore[arg-type]


def policy(**latency: object) -> LatencyPolicy:
    config = PolicyConfig(name="latency", latency=LatencyPolicyConfig(**latency))  # type: ignore[arg-type]
    built = make_policy(config)
    assert isinstance(built, LatencyPolicy)
    return built


def fitted(load: EngineLoad, s_per_token: float, overhead: float = 0.01) -> EngineLoad:
    """``load`` with an engine that has been timed at ``s_per_token``."""
    model = LatencyModel(LatencyPriors())
    fit = model.of(EngineKey("x:1"))
    for i in range(200):
        tokens = 500 * (i % 30)
        fit.observe_ttft(0.0, tokens, overhead + s_per_token * tokens)
    load.latency = fit
    return load


def test_a_long_prompt_goes_where_fewer_sequences_are_decoding() -> None:
    # Equal caches, equal decode KV: A has 40 sequences decoding, B has 4.
    loads = {
        A: EngineLoad(requests=40, decoding=40, decode_blocks=400),
        B: EngineLoad(requests=4, decoding=4, decode_blocks=400),
    }
    decision = policy().choose(req(prompt_tokens=16_000), [A, B], {}, loads)  # the defaults
    assert decision.engine == B
    harm = {s.engine: s.harm for s in decision.scores}
    assert harm[A] == pytest.approx(10 * harm[B]) and harm[B] > 0
    # kv_cost sees no difference between them (and breaks the tie by other means).
    kv = KVCostPolicy(PolicyConfig()).score(req(prompt_tokens=16_000), [A, B], {}, loads)
    assert kv[0].total == kv[1].total


def test_requests_queued_ahead_count_as_decoding_by_the_time_its_chunks_run() -> None:
    # A's 30 requests are all still prefilling; B has 10 decoding.
    loads = {
        A: EngineLoad(requests=30, prefill_tokens=3000),
        B: EngineLoad(requests=10, decoding=10, prefill_tokens=3000),
    }
    by_requests = policy().choose(req(prompt_tokens=16_000), [A, B], {}, loads)
    assert by_requests.engine == B
    by_decoding = policy(harm_counts="decoding").choose(
        req(prompt_tokens=16_000), [A, B], {}, loads
    )
    assert by_decoding.engine == A  # counting only those decoding now misses A's queue


def test_without_the_harm_weight_decoding_sequences_do_not_matter() -> None:
    loads = {A: EngineLoad(requests=40, decoding=40), B: EngineLoad(requests=4, decoding=4)}
    scores = policy(itl_weight=0.0).score(req(), [A, B], {}, loads)
    assert scores[0].total == scores[1].total


def test_every_term_is_in_seconds_of_the_engines_speed() -> None:
    # A holds 300 of the request's 500 blocks and has 9,000 tokens queued, 2 requests
    # decoding of 5 in flight; B holds 100 blocks, nothing queued, 1 decoding.
    matches = {A: Match(300), B: Match(100)}
    loads = {
        A: EngineLoad(requests=5, prefill_tokens=9000, decoding=2),
        B: EngineLoad(requests=1, decoding=1),
    }
    p = policy(slowdown_weight=0.5)
    scores = {s.engine: s for s in p.score(req(max_tokens=200), ENGINES, matches, loads)}
    a, b, per_seq = 50e-6, 0.02, 200e-6  # the priors: s/token, overhead, TPOT s/sequence
    uncached = {A: 8000 - 300 * 16, B: 8000 - 100 * 16, C: 8000}
    assert scores[A].queue == pytest.approx(a * 9000)  # the wait for what is queued
    assert scores[B].queue == scores[C].queue == 0.0
    for engine, requests, decoding in ((A, 5, 2), (B, 1, 1), (C, 0, 0)):
        s = scores[engine]
        # Nobody has sent either engine work lately: a prefill costs only its own time.
        assert s.prefill == pytest.approx(a * uncached[engine])
        # Everyone in flight there waits for its chunks.
        assert s.harm == pytest.approx(a * uncached[engine] * requests)
        # Its 200 tokens each lengthen the steps of the sequences decoding there.
        assert s.decode == pytest.approx(0.5 * 200 * per_seq * decoding)
        assert s.total == pytest.approx(b + s.queue + s.prefill + s.harm + s.decode)
        assert s.ttft == pytest.approx(b + s.queue + a * uncached[engine])


def test_a_decode_is_priced_at_what_the_engine_answers_not_at_a_generous_cap() -> None:
    tracker = LoadTracker(block_size=16)
    for length in (80, *[40] * 100):  # the first answer counts whole, then a moving mean
        ticket = tracker.begin(A, 100, 0, 4096)
        tracker.prefilled(ticket)
        ticket.output_tokens = length
        tracker.end(ticket)
        if length == 80:
            assert tracker.view[A].output_tokens == 80
    assert tracker.view[A].output_tokens == pytest.approx(40, abs=0.5)
    tracker.prefilled(tracker.begin(A, 100, 0, 4096))  # one decoding there now
    p = policy()
    (capped,) = p.score(req(max_tokens=4096), [A], {}, tracker.view)
    (short,) = p.score(req(max_tokens=10), [A], {}, tracker.view)
    per_seq = 200e-6  # the prior TPOT slope
    assert capped.decode == pytest.approx(0.1 * tracker.view[A].output_tokens * per_seq)
    assert short.decode == pytest.approx(0.1 * 10 * per_seq)  # max_tokens below the mean
    # An engine none of whose answers was counted yet: max_tokens.
    (unknown,) = p.score(req(max_tokens=4096), [B], {}, {B: EngineLoad(decoding=1)})
    assert unknown.decode == pytest.approx(0.1 * 4096 * per_seq)


def test_a_prefill_costs_more_where_work_arrives_at_a_high_rate() -> None:
    clock = [10.0]
    tracker = LoadTracker(block_size=16, clock=lambda: clock[0])
    # A was sent 20,000 uncached tokens just now: at 50 µs a token that is a second of
    # prefill, offered at ln 2 / 2 s of it per second (the estimate's half-life is 2 s).
    tracker.begin(A, 20_000, 0, 1)
    tracker.end(tracker.begin(B, 10, 10, 1))  # B: known, idle, offered nothing
    p = LatencyPolicy(PolicyConfig(name="latency"), clock=lambda: clock[0])
    scores = {s.engine: s for s in p.score(req(prompt_tokens=1000), [A, B], {}, tracker.view)}
    a = 50e-6
    u = a * 20_000 * math.log(2) / 2.0
    assert scores[B].prefill == pytest.approx(a * 1000)
    assert scores[A].prefill == pytest.approx(a * 1000 * (1 + u / (1 - u)))
    # Two half-lives later a quarter of it is left.
    clock[0] += 4.0
    later = {s.engine: s for s in p.score(req(prompt_tokens=1000), [A], {}, tracker.view)}
    u4 = u / 4
    assert later[A].prefill == pytest.approx(a * 1000 * (1 + u4 / (1 - u4)))
    # With three router replicas sending alike, the engine is offered three times as much.
    tracker.set_replicas(3)
    tripled = {s.engine: s for s in p.score(req(prompt_tokens=1000), [A], {}, tracker.view)}
    assert tripled[A].prefill == pytest.approx(a * 1000 * (1 + 3 * u4 / (1 - 3 * u4)))


def test_on_a_saturated_engine_a_prefill_costs_at_most_prefill_weight_times_itself() -> None:
    loads = {A: EngineLoad(offered=1e9, offered_at=0.0)}  # offered far beyond capacity
    for weight in (2.0, 3.0):
        p = LatencyPolicy(PolicyConfig(name="latency", prefill_weight=weight), clock=lambda: 0.0)
        (score,) = p.score(req(prompt_tokens=1000), [A], {}, loads)
        assert score.prefill == pytest.approx(weight * 50e-6 * 1000)


def test_a_slow_engine_is_priced_at_its_own_speed_and_alike_ones_at_the_median() -> None:
    loads = {
        A: fitted(EngineLoad(prefill_tokens=4000), 150e-6),
        B: fitted(EngineLoad(prefill_tokens=6000), 50e-6),
        C: fitted(EngineLoad(prefill_tokens=6000), 55e-6),
    }
    decision = policy().choose(req(prompt_tokens=2000), ENGINES, {}, loads)
    ttft = {s.engine: s.ttft for s in decision.scores}
    # B and C are within 25% of the median: one speed, equal predictions.
    assert ttft[B] == pytest.approx(ttft[C])
    assert ttft[A] > ttft[B]  # fewer queued tokens, but three times slower
    assert decision.engine in (B, C)
    assert "ttft=" in decision.summary() and "harm=" in decision.summary()


def test_an_engine_predicted_to_meet_the_slo_is_preferred_over_a_cheaper_one() -> None:
    # A holds the prefix (cheapest by cost) but has a long decode batch: its TPOT misses.
    loads = {A: EngineLoad(decoding=200), B: EngineLoad(decoding=2)}
    p = policy(itl_weight=0.0)
    free = p.choose(req(), [A, B], {A: Match(400)}, loads)
    assert free.engine == A
    bound = p.choose(req(slo_tpot_s=0.02), [A, B], {A: Match(400)}, loads)
    assert bound.engine == B and bound.reason != "slo_unmet"
    assert (p.slo_checked, p.slo_unmet) == (1, 0)


def test_when_no_engine_can_meet_the_slo_the_least_violation_wins_and_is_counted() -> None:
    loads = {A: EngineLoad(prefill_tokens=100_000), B: EngineLoad(prefill_tokens=20_000)}
    p = policy()
    decision = p.choose(req(slo_ttft_s=0.1), [A, B], {A: Match(400)}, loads)
    assert decision.engine == B and decision.reason == "slo_unmet"
    assert (p.slo_checked, p.slo_unmet) == (1, 1)


def test_the_session_goes_back_to_its_engine_on_a_near_tie() -> None:
    p = policy()
    first = p.choose(req("t1", session="conv-7"), ENGINES, {}, {})
    # Next turn: another engine is a hair cheaper; the session bonus keeps the engine.
    loads = {first.engine: EngineLoad(prefill_tokens=50)}  # 2.5 ms behind
    second = p.choose(req("t2", session="conv-7"), ENGINES, {}, loads)
    assert second.engine == first.engine and second.reason == "session"
    assert "session=-" in second.summary()
    # Far more than a tie behind (100 ms of queue): the others win, key or not.
    behind = {first.engine: EngineLoad(prefill_tokens=2000)}
    assert p.choose(req("t3", session="conv-7"), ENGINES, {}, behind).engine != first.engine
    assert p.choose(req("t4"), ENGINES, {}, behind).engine != first.engine


def test_the_session_bonus_never_pulls_onto_a_queued_engine() -> None:
    p = policy(session_bonus_ms=5000.0, session_max_wait_ms=1000.0)
    first = p.choose(req("t1", session="s"), [A, B], {}, {})
    # Its engine is now 2 s behind (the bonus is gone past 1 s of predicted wait).
    loads = {first.engine: EngineLoad(prefill_tokens=40_000)}
    again = p.choose(req("t2", session="s"), [A, B], {}, loads)
    assert again.engine != first.engine
    chosen = {s.engine: s.bonus for s in again.scores}
    assert chosen[first.engine] == 0.0


def test_sessions_expire_and_leave_with_their_engine() -> None:
    now = [0.0]
    p = LatencyPolicy(PolicyConfig(name="latency"), clock=lambda: now[0])
    p.choose(req("t1", session="s"), [A], {}, {})
    assert p.sessions.get("s", now[0]) == A
    p.forget(A)
    assert p.sessions.get("s", now[0]) is None
    p.choose(req("t2", session="s"), [A], {}, {})
    now[0] += 601
    assert p.sessions.get("s", now[0]) is None


def test_default_slos_per_model() -> None:
    cfg = LatencyPolicyConfig(slo={"*": SLOConfig(ttft_ms=500), "big": SLOConfig(tpot_ms=40)})
    assert cfg.slo_for("small") == SLOConfig(ttft_ms=500)
    assert cfg.slo_for("big") == SLOConfig(tpot_ms=40)
    assert LatencyPolicyConfig().slo_for("any") is None


async def test_a_reload_keeps_the_fitted_lines_and_the_sessions() -> None:
    config = PolicyConfig(name="latency")
    tracker = LoadTracker(block_size=16, latency=LatencyModel(priors_of(config)))
    p = make_policy(config)
    core = RoutingCore(MemoryIndex(), p, config, tracker)
    fit = tracker.latency.of(A)  # type: ignore[union-attr]
    for i in range(50):
        fit.observe_ttft(float(i), 100 * i, 0.01 + 90e-6 * 100 * i)
    decision = await core.route(req("t1", session="s"), [A, B])
    learnt = fit.prefill_s_per_token
    core.reconfigure(config.model_copy(update={"latency": LatencyPolicyConfig(itl_weight=0.5)}), 0)
    assert core.policy is p
    assert p.sessions.get("s", 0.0) == decision.engine
    assert tracker.latency.of(A) is fit  # type: ignore[union-attr]
    assert fit.prefill_s_per_token == pytest.approx(learnt)
    assert core.policy.config.latency.itl_weight == 0.5


async def first_burst(idle_prefill_weight: float | None) -> list[int]:
    """Requests per engine after 16 chats open at once on 4 idle engines with one new
    1,000-token system prompt (+200 tokens of question each): the real index (each
    choice recorded as pending) and load tracker, nothing finished yet."""
    config = PolicyConfig(
        name="latency", latency=LatencyPolicyConfig(idle_prefill_weight=idle_prefill_weight)
    )
    tracker = LoadTracker(block_size=16)
    core = RoutingCore(MemoryIndex(), make_policy(config), config, tracker)
    engines = [EngineKey(f"127.0.0.1:{9000 + i}") for i in range(4)]
    system = list(range(62))  # 992 tokens: the shared blocks
    for n in range(16):
        keys = system + [1000 * (n + 1) + k for k in range(13)]
        decision = await core.route(RouteRequest(f"c{n}", keys, 1205, 16), engines)
        tracker.begin(decision.engine, 1205, decision.cached_tokens, 100)
    return sorted((tracker.view[e].requests for e in engines), reverse=True)


async def test_a_first_burst_takes_the_idle_engines() -> None:
    # Queueing behind the engine computing the new prompt delays those already queued
    # there (they share its steps); an idle engine recomputes it at no one else's cost.
    assert await first_burst(None) == [4, 4, 4, 4]


async def same_prefix_burst(offered: int) -> list[int]:
    """Where 24 requests sharing a 2,000-token prefix go, all at once, on 8 engines
    that were each offered ``offered`` uncached tokens just before."""
    clock = [0.0]
    config = PolicyConfig(name="latency")
    tracker = LoadTracker(block_size=16, clock=lambda: clock[0])
    core = RoutingCore(MemoryIndex(), make_policy(config, lambda: clock[0]), config, tracker)
    engines = [EngineKey(f"127.0.0.1:{9000 + i}") for i in range(8)]
    for engine in engines:
        tracker.end(tracker.begin(engine, offered, 0, 1))
    shared = list(range(125))
    counts = [0] * 8
    for n in range(24):
        keys = shared + [10_000 * (n + 1) + k for k in range(6)]
        decision = await core.route(RouteRequest(f"b{n}", keys, 2096, 16), engines)
        tracker.begin(decision.engine, 2096, decision.cached_tokens, 64)
        counts[engines.index(decision.engine)] += 1
    return sorted(counts, reverse=True)


async def test_a_shared_prefix_is_copied_onto_idle_engines_and_kept_together_on_busy_ones() -> None:
    # Idle engines: computing the prefix once on each costs nobody anything, so the
    # burst spreads as round robin would (each engine's first request computes it).
    assert await same_prefix_burst(0) == [3] * 8
    # Engines each offered a second of prefill per second lately (saturated): a copy
    # delays whoever arrives behind it there, so the burst stays on fewer engines.
    busy = await same_prefix_burst(60_000)
    assert busy[0] >= 6 and busy.count(0) >= 4, busy


def test_the_idle_prefill_weight_prices_only_engines_with_nothing_in_flight() -> None:
    busy = {A: EngineLoad(requests=1, prefill_tokens=100), B: EngineLoad()}
    scores = {s.engine: s for s in policy(idle_prefill_weight=0.5).score(req(), [A, B], {}, busy)}
    a = 50e-6  # the prior's seconds per token
    assert scores[A].prefill == pytest.approx(a * 8000)  # measured: nothing offered lately
    assert scores[B].prefill == pytest.approx(0.5 * a * 8000)
    assert scores[B].ttft == pytest.approx(scores[A].ttft - a * 100)  # the prediction is not


def test_of_two_engines_the_slow_one_stands_out() -> None:
    loads = {A: fitted(EngineLoad(), 50e-6), B: fitted(EngineLoad(), 5000e-6)}
    scores = {s.engine: s for s in policy().score(req(prompt_tokens=2000), [A, B], {}, loads)}
    assert scores[A].ttft == pytest.approx(2000 * 50e-6, abs=0.015)  # its own speed
    assert scores[B].ttft > 50 * scores[A].ttft * 0.8


def test_an_objective_too_small_to_compare_never_breaks_the_choice() -> None:
    p = policy()
    for slo in (5e-324, 1e-310):  # what 1e-321 ms would be; the API refuses below 1 µs
        decision = p.choose(req(slo_ttft_s=slo), [A, B], {}, {})
        assert decision.engine in (A, B) and decision.reason == "slo_unmet"


def test_a_long_session_key_is_kept_as_its_hash() -> None:
    p = policy()
    key = "u" * 5000
    first = p.choose(req("t1", session=key), ENGINES, {}, {})
    assert len(p.sessions) == 1 and key not in p.sessions._pins
    assert p.sessions.get(session_key(key), 0.0) == first.engine
    assert len(session_key(key)) <= MAX_KEY_CHARS
