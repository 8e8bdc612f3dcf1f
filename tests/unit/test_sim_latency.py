"""The ``latency`` policy in the simulator: the latency model learns each engine's speed
from the virtual clock, a slow engine is priced as such, SLOs and sessions act."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from router.config import PolicyConfig
from router.engine_model import EngineParams
from router.policy.latency import LatencyPolicy
from router.policy.latency_config import LatencyPolicyConfig, SLOConfig
from router.sim.cluster import ClusterSim, Fleet, SimSettings
from router.workloads.generated import shared_prefix_workload, words
from router.workloads.spec import RequestSpec

PARAMS = EngineParams(num_gpu_blocks=4_096, max_model_len=16_384)


def sim(policy: PolicyConfig, **changes: object) -> ClusterSim:
    return ClusterSim(SimSettings(Fleet(engines=4), PARAMS, policy, **changes))  # type: ignore[arg-type]


def load(n: int = 96, every: float = 0.05) -> list[RequestSpec]:
    """Open-loop prompts of 3,000 tokens (groups of 4 sharing 2,000), one every ``every``."""
    specs = shared_prefix_workload(n // 4, 4, 2_000, 1_000, 20, seed=5)
    for k, spec in enumerate(specs):
        spec.at = k * every
    return specs


def test_the_model_learns_the_engines_speed_on_the_virtual_clock() -> None:
    cluster = sim(PolicyConfig(name="latency"))
    asyncio.run(cluster.run(load()))
    model = cluster.loads.latency
    assert model is not None
    fits = list(model.engines.values())
    assert sum(f.ttft.observations for f in fits) == 96
    # The engine model's prefill costs 50 µs a token (PARAMS' default) plus its steps.
    for fit in fits:
        assert 30e-6 < fit.prefill_s_per_token < 90e-6
        assert fit.tpot.observations > 0


def test_a_slow_engine_gets_less_work_under_the_latency_policy_than_under_kv_cost() -> None:
    share = {}
    for name in ("kv_cost", "latency"):
        cluster = sim(PolicyConfig(name=name), slow_engines=1, slowdown=3.0)
        run = asyncio.run(cluster.run(load(160, 0.03)))
        counts = Counter(r.engine for r in run.records)
        share[name] = counts[cluster.engines[0].key.label] / len(run.records)
        if name == "latency":
            slow, fast = cluster.engines[0].key, cluster.engines[1].key
            model = cluster.loads.latency
            assert model is not None
            assert model.of(slow).prefill_s_per_token > 2 * model.of(fast).prefill_s_per_token
    assert share["latency"] < share["kv_cost"], share


def test_an_slo_no_engine_can_meet_is_counted_for_every_request() -> None:
    policy = PolicyConfig(
        name="latency", latency=LatencyPolicyConfig(slo={"*": SLOConfig(ttft_ms=0.001)})
    )
    cluster = sim(policy)
    run = asyncio.run(cluster.run(load(24)))
    chosen = cluster.core.policy
    assert isinstance(chosen, LatencyPolicy)
    assert chosen.slo_checked == chosen.slo_unmet == 24
    assert {r.reason for r in run.records} == {"slo_unmet"}


@pytest.mark.parametrize("bonus_ms", [0.0, 1000.0])
def test_a_session_stays_on_its_engine_with_a_bonus(bonus_ms: float) -> None:
    policy = PolicyConfig(
        name="latency",
        latency=LatencyPolicyConfig(session_bonus_ms=bonus_ms, session_max_wait_ms=10_000),
    )
    cluster = sim(policy)
    # 8 sessions of 4 unrelated prompts each: only the session ties a session together.
    rng = random.Random(4)
    sessions = [f"session-{n % 8}" for n in range(32)]
    rng.shuffle(sessions)
    specs = [
        RequestSpec(prompt=words(rng, 300), max_tokens=rng.randint(10, 60), group=session)
        for session in sessions
    ]
    run = asyncio.run(cluster.run(specs))
    engines: dict[str, set[str]] = {}
    for r in run.records:
        engines.setdefault(r.group, set()).add(r.engine)
    stuck = sum(len(used) == 1 for used in engines.values())
    if bonus_ms:
        assert stuck == len(engines)
    else:
        assert stuck < len(engines)
