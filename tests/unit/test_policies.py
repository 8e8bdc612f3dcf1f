"""Routing policies: the default cost policy's terms and reasons, and every baseline."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import pytest
from pydantic import BaseModel, Field

from router.fleet.load import EngineLoad, LoadTracker, LoadView
from router.index.base import Match
from router.policy import POLICY_NAMES, make_policy, registry
from router.policy.base import Decision, Policy, RouteRequest
from router.policy.baselines import LeastLoaded, PowerOfTwo, RandomChoice, RoundRobin, Session
from router.policy.kv_cost import KVCostPolicy
from router.policy.registry import PolicyConfig
from router.policy.sglang import CacheAwareSGLang
from router.policy.sglang_config import SGLangCacheAwareConfig
from router.types import EngineKey

ENGINES = [EngineKey(f"127.0.0.1:{8000 + i}") for i in range(4)]
A, B, C, D = ENGINES


def req(
    rid: str = "r1", prompt_tokens: int = 2000, keys: list[int] | None = None, **kw
) -> RouteRequest:
    keys = keys if keys is not None else list(range(prompt_tokens // 16))
    return RouteRequest(rid, keys, prompt_tokens, 16, **kw)


class TestKVCost:
    def test_prefers_the_engine_holding_the_prefix(self) -> None:
        d = KVCostPolicy(PolicyConfig()).choose(req(), ENGINES, {B: Match(100)}, {})
        assert d.engine == B and d.reason == "prefix_hit" and d.matched_blocks == 100

    def test_cost_terms_are_reported_with_their_numbers(self) -> None:
        loads = {A: EngineLoad(prefill_tokens=320, decode_blocks=7)}
        d = KVCostPolicy(PolicyConfig(decode_weight=2.0)).choose(req(), [A], {A: Match(10)}, loads)
        (s,) = d.scores
        assert s.cached_tokens == 160
        assert s.queue == pytest.approx(320 / 16)
        assert s.prefill == pytest.approx(2 * (2000 - 160) / 16)
        assert s.decode == pytest.approx(14.0)
        assert s.total == pytest.approx(s.queue + s.prefill + s.decode)
        assert "match=10" in d.summary() and "prefill=230.0" in d.summary()
        assert A.label in d.describe()

    def test_a_full_match_never_credits_the_last_token(self) -> None:
        d = KVCostPolicy(PolicyConfig()).choose(req(prompt_tokens=2000), [A], {A: Match(125)}, {})
        assert d.cached_tokens == 1984

    def test_load_outweighs_a_hit_once_the_queue_costs_more_than_a_recompute(self) -> None:
        busy = {A: EngineLoad(prefill_tokens=9000)}
        d = KVCostPolicy(PolicyConfig()).choose(req(), [A, B], {A: Match(125)}, busy)
        assert d.engine == B and d.reason == "load_over_prefix"

    def test_no_prefix_anywhere_is_said(self) -> None:
        d = KVCostPolicy(PolicyConfig()).choose(req(), ENGINES, {}, {})
        assert d.reason == "no_prefix"

    def test_ties_break_by_request_id_deterministically(self) -> None:
        policy = KVCostPolicy(PolicyConfig())
        first = [policy.choose(req(f"r{i}"), ENGINES, {}, {}).engine for i in range(64)]
        again = [policy.choose(req(f"r{i}"), ENGINES, {}, {}).engine for i in range(64)]
        assert first == again
        assert set(first) == set(ENGINES)

    def test_equal_costs_go_to_the_engine_routed_to_least_recently(self) -> None:
        tracker = LoadTracker(16)
        for engine in (C, A, D):  # B never, then C, A, D, each finished again
            tracker.end(tracker.begin(engine, 100, 0, 1))
        policy = KVCostPolicy(PolicyConfig())
        picks = [policy.choose(req(f"t{i}"), ENGINES, {}, tracker.view).engine for i in range(20)]
        assert set(picks) == {B}
        tracker.end(tracker.begin(B, 100, 0, 1))
        assert policy.choose(req("next"), ENGINES, {}, tracker.view).engine == C

    def test_offloaded_blocks_are_worth_less(self) -> None:
        policy = KVCostPolicy(PolicyConfig(offload_weight=0.5))
        d = policy.choose(req(), [A, B], {A: Match(100, offloaded=100), B: Match(60)}, {})
        assert d.engine == B

    def test_temperature_samples_but_stays_reproducible(self) -> None:
        policy = KVCostPolicy(PolicyConfig(temperature=1.0))
        matches = {A: Match(60)}
        picks = [policy.choose(req(f"q{i}"), ENGINES, matches, {}).engine for i in range(400)]
        assert picks == [
            policy.choose(req(f"q{i}"), ENGINES, matches, {}).engine for i in range(400)
        ]
        counts = Counter(picks)
        assert counts[A] == max(counts.values()) and len(counts) == 4

    def test_reported_terms_count_only_while_fresh(self) -> None:
        now = [100.0]
        cfg = PolicyConfig(waiting_weight=50.0, report_max_age_s=5.0)
        policy = KVCostPolicy(cfg, clock=lambda: now[0])
        loads = {A: EngineLoad(waiting=3, reported_at=99.0)}
        assert policy.choose(req(), [A, B], {}, loads).engine == B
        now[0] = 200.0
        assert policy.score(req(), [A], {}, loads)[0].reported == 0.0


class TestBaselines:
    def test_round_robin_cycles(self) -> None:
        rr = RoundRobin()
        assert [rr.choose(req(), ENGINES, {}, {}).engine for _ in range(8)] == ENGINES * 2

    def test_random_depends_only_on_the_request_id(self) -> None:
        policy = RandomChoice()
        picks = [policy.choose(req(f"x{i}"), ENGINES, {}, {}).engine for i in range(100)]
        assert picks == [policy.choose(req(f"x{i}"), ENGINES, {}, {}).engine for i in range(100)]
        assert set(picks) == set(ENGINES)

    def test_least_loaded_takes_the_fewest_in_flight(self) -> None:
        loads = {A: EngineLoad(requests=3), B: EngineLoad(requests=1), C: EngineLoad(requests=2)}
        assert LeastLoaded().choose(req(), [A, B, C], {}, loads).engine == B

    def test_power_of_two_picks_the_lighter_of_its_pair(self) -> None:
        loads = {e: EngineLoad(requests=i) for i, e in enumerate(ENGINES)}
        policy = PowerOfTwo()
        for i in range(50):
            engine = policy.choose(req(f"p{i}"), ENGINES, {}, loads).engine
            assert engine != D  # D is the heaviest, so it never wins its pair

    def test_session_is_sticky_and_moves_only_sessions_of_a_removed_engine(self) -> None:
        policy = Session()
        before = {
            s: policy.choose(req(session=s), ENGINES, {}, {}).engine for s in map(str, range(200))
        }
        after = {s: policy.choose(req(session=s), ENGINES[:3], {}, {}).engine for s in before}
        moved = {s for s in before if before[s] != after[s]}
        assert moved == {s for s in before if before[s] == D}
        assert len(set(before.values())) == 4

    def test_session_without_a_key_keeps_a_shared_first_block_together(self) -> None:
        policy = Session()
        picks = {
            policy.choose(req(f"n{i}", keys=[7, i]), ENGINES, {}, {}).engine for i in range(20)
        }
        assert len(picks) == 1


class TestCacheAwareSGLang:
    def make(self, **kw) -> CacheAwareSGLang:
        return CacheAwareSGLang(SGLangCacheAwareConfig(**kw), clock=lambda: 0.0)

    def test_a_match_above_the_threshold_follows_history(self) -> None:
        policy = self.make()
        first = policy.choose(req("a", keys=list(range(100))), ENGINES, {}, {})
        second = policy.choose(req("b", keys=[*range(90), 5000]), ENGINES, {}, {})
        assert second.engine == first.engine and second.reason == "cache_hit"

    def test_a_weak_match_goes_to_the_fewest_requests_in_flight(self) -> None:
        # As sglang-router 0.3.2: the fewest in flight, the first of them on a tie, not
        # the smallest tree (A's tree is the largest here, yet it has room).
        policy = self.make()
        policy.choose(req("a", keys=list(range(100))), [A], {}, {})
        policy.choose(req("b", keys=list(range(200, 210))), [B], {}, {})
        loads = {A: EngineLoad(requests=2), B: EngineLoad(requests=3), C: EngineLoad(requests=5)}
        weak = req("c", keys=[*range(10), *range(500, 600)])
        d = policy.choose(weak, [A, B, C], {}, loads)
        assert d.engine == A and d.reason == "min_load"
        tied = {A: EngineLoad(requests=3), B: EngineLoad(requests=3), C: EngineLoad(requests=3)}
        assert policy.choose(req("d", keys=[9000]), [C, B, A], {}, tied).engine == C

    def test_imbalance_means_least_loaded_whatever_the_cache(self) -> None:
        policy = self.make()
        policy.choose(req("a", keys=list(range(100))), [A], {}, {})
        loads = {
            A: EngineLoad(requests=100),
            B: EngineLoad(requests=10),
            C: EngineLoad(requests=20),
        }
        d = policy.choose(req("b", keys=list(range(100))), [A, B, C], {}, loads)
        assert d.engine == B and d.reason == "balance"

    def test_both_thresholds_must_trip(self) -> None:
        policy = self.make()
        policy.choose(req("a", keys=list(range(100))), [A], {}, {})
        # 100 vs 60: the absolute gap (40) is under 64, so the cache still decides.
        loads = {A: EngineLoad(requests=100), B: EngineLoad(requests=60)}
        assert policy.choose(req("b", keys=list(range(100))), [A, B], {}, loads).engine == A

    def test_trees_are_trimmed_by_lru(self) -> None:
        now = [0.0]
        policy = CacheAwareSGLang(
            SGLangCacheAwareConfig(max_tree_size=16 * 50, eviction_interval_s=10),
            clock=lambda: now[0],
        )
        policy.choose(req("a", keys=list(range(100))), [A], {}, {})
        now[0] = 11.0
        policy.choose(req("b", keys=[9999]), [A], {}, {})
        depth, _ = policy._match(list(range(100)), [A])
        assert depth < 100


def test_every_named_policy_can_be_built() -> None:
    for name in (*POLICY_NAMES, "default"):
        assert make_policy(PolicyConfig(name=name)).name in POLICY_NAMES


def test_load_tracker_moves_work_from_prefill_to_decode_and_releases_it() -> None:
    tracker = LoadTracker(block_size=16)
    t = tracker.begin(A, prompt_tokens=1000, cached_tokens=400, max_tokens=50)
    assert (tracker.view[A].requests, tracker.view[A].prefill_tokens) == (1, 600)
    tracker.prefilled(t)
    # only the blocks this request adds: 600 uncached prompt tokens and 50 output tokens
    assert (tracker.view[A].prefill_tokens, tracker.view[A].decode_blocks) == (0, 38 + 4)
    tracker.end(t)
    tracker.end(t)
    load = tracker.view[A]
    assert (load.requests, load.prefill_tokens, load.decode_tokens, load.decode_blocks) == (
        0,
        0,
        0,
        0,
    )
    assert tracker.in_flight == 0


# ------------------------------------------------------------------ adding a policy


class EveryNthParams(BaseModel):
    """A toy policy's own parameters: its section of ``policy``."""

    nth: int = Field(2, ge=1)


class ToyPolicyConfig(PolicyConfig):
    """``PolicyConfig`` with the toy's section, as router/policy/registry.py would hold it."""

    every_nth: EveryNthParams = Field(default_factory=EveryNthParams)


class EveryNth(Policy):
    """A toy policy defined here (not shipped): the candidate at index ``nth - 1``."""

    name = "every_nth"

    def __init__(self, params: EveryNthParams) -> None:
        self.params = params

    @classmethod
    def from_config(cls, config: PolicyConfig, clock: Callable[[], float]) -> EveryNth:
        assert isinstance(config, ToyPolicyConfig)
        return cls(config.every_nth)

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[EngineKey],
        matches: Mapping[EngineKey, Match],
        loads: LoadView,
    ) -> Decision:
        engine = candidates[min(self.params.nth, len(candidates)) - 1]
        return Decision(engine, self.name, "every_nth", matches.get(engine, Match(0)).blocks)


def test_a_policy_with_parameters_is_its_module_and_its_config_section(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Adding a policy is its class and one line of ``router.policy.registry.POLICIES`` beside its
    parameters; the configuration accepts the name and ``make_policy`` builds it."""
    with pytest.raises(ValueError, match="unknown policy 'every_nth'"):
        PolicyConfig(name="every_nth")
    monkeypatch.setitem(registry.POLICIES, "every_nth", f"{__name__}:EveryNth")
    config = ToyPolicyConfig(name="every_nth", every_nth=EveryNthParams(nth=3))
    policy = make_policy(config)
    assert isinstance(policy, EveryNth) and policy.params.nth == 3
    decision = policy.choose(req(), ENGINES, {}, {})
    assert decision.engine == C and decision.reason == "every_nth"
