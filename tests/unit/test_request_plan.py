"""The request plan (router/plan.py): pure, over any candidate pools."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest

from router.admission import Overloaded
from router.config import DisaggregationConfig, PolicyConfig
from router.core import RoutingCore, Saturated
from router.fleet.load import LoadTracker
from router.index.memory import MemoryIndex
from router.plan import Planner, WaitForRoom, refuse
from router.policy import make_decode_policy, make_policy
from router.policy.base import NoCandidates, RouteRequest
from router.policy.disagg import SplitDecision
from router.types import EngineKey

BS = 16


class Pools:
    """Engines by role, all healthy, one model each."""

    def __init__(self, roles: dict[str, str], model: str = "m") -> None:
        self.roles = roles
        self.model = model

    def candidates(
        self, model: str, roles: tuple[str, ...] = ("both",), exclude: Iterable[str] = ()
    ) -> list[EngineKey]:
        skip = set(exclude)
        return [EngineKey(e) for e, role in self.roles.items() if role in roles and e not in skip]

    def is_disaggregated(self, model: str) -> bool:
        return any(role in ("prefill", "decode") for role in self.roles.values())

    def models(self) -> list[str]:
        return [self.model]


def planner(
    roles: dict[str, str],
    wait: WaitForRoom = refuse,
    on_split: Callable[[SplitDecision], None] | None = None,
) -> Planner:
    loads = LoadTracker(block_size=BS)
    policy = make_policy(PolicyConfig())
    core = RoutingCore(MemoryIndex(), policy, PolicyConfig(), loads)
    disagg = DisaggregationConfig()
    decode_policy = make_decode_policy(PolicyConfig(), disagg, policy)
    return Planner(
        Pools(roles), core, decode_policy, disagg, lambda m: "nixl", wait=wait, on_split=on_split
    )


def request(tokens: int, rid: str = "r") -> RouteRequest:
    return RouteRequest(rid, list(range(1, tokens // BS + 1)), tokens, BS, 8)


PD = {"p0:1": "prefill", "p1:1": "prefill", "d0:1": "decode", "d1:1": "decode"}


async def test_an_aggregated_pool_plans_one_engine() -> None:
    plan = await planner({"a:1": "both", "b:1": "both"}).plan("m", request(64), 64)
    assert plan.mode == "aggregated" and plan.split is None and plan.prefill is None
    assert plan.decode.engine.endpoint in ("a:1", "b:1")
    assert plan.reason == plan.decode.reason and plan.dialect is None


async def test_a_long_prompt_splits_onto_a_prefill_engine_in_the_models_dialect() -> None:
    plan = await planner(PD).plan("m", request(2_000), 2_000)
    assert plan.mode == "split" and plan.dialect == "nixl"
    assert plan.decode.engine.endpoint.startswith("d")
    assert plan.prefill is not None and plan.prefill.engine.endpoint.startswith("p")


async def test_a_short_prompt_stays_on_the_decode_engine_saying_why() -> None:
    plan = await planner(PD).plan("m", request(64), 64)
    assert plan.mode == "local" and plan.prefill is None
    assert plan.reason == "short_uncached"


async def test_a_retry_plans_without_the_engines_that_failed() -> None:
    plans = planner(PD)
    first = await plans.plan("m", request(2_000), 2_000)
    again = await plans.plan("m", request(2_000), 2_000, exclude={first.decode.engine.endpoint})
    assert again.decode.engine != first.decode.engine
    assert first.prefill is not None
    other = await plans.prefill(request(2_000), "m", exclude={first.prefill.engine.endpoint})
    assert other is not None and other.engine != first.prefill.engine
    assert await plans.prefill(request(2_000), "m", exclude={"p0:1", "p1:1"}) is None
    with pytest.raises(NoCandidates):
        await plans.plan("m", request(64), 64, exclude={"d0:1", "d1:1"})


async def test_the_subset_limits_the_serving_engine_only() -> None:
    plan = await planner(PD).plan("m", request(2_000), 2_000, subset={"d1:1"})
    assert plan.decode.engine.endpoint == "d1:1" and plan.prefill is not None


async def test_every_split_decision_is_reported() -> None:
    seen: list[SplitDecision] = []
    plans = planner(PD, on_split=seen.append)
    await plans.plan("m", request(2_000), 2_000)
    await plans.plan("m", request(64), 64)
    assert [s.split for s in seen] == [True, False]


async def test_full_engines_wait_through_the_injected_callable_then_refuse() -> None:
    waited: list[str] = []

    async def wait(route: RouteRequest, full: Saturated) -> None:
        waited.append(route.request_id)
        plans.core.loads.end(held)  # room appears

    plans = planner({"a:1": "both"}, wait=wait)
    plans.core.max_per_engine = 1
    held = plans.core.loads.begin(EngineKey("a:1"), 10, 0, 1)
    plan = await plans.plan("m", request(64, "waits"), 64)
    assert waited == ["waits"] and plan.decode.engine.endpoint == "a:1"

    refusing = planner({"a:1": "both"})
    refusing.core.max_per_engine = 1
    refusing.core.loads.begin(EngineKey("a:1"), 10, 0, 1)
    with pytest.raises(Overloaded):
        await refusing.plan("m", request(64), 64)


async def test_a_request_without_a_prompt_is_placed_by_load_among_serving_engines() -> None:
    decision = await planner(PD).on_load("get", BS)
    assert decision.engine.endpoint in ("d0:1", "d1:1")
    # Nothing was hashed: no verdict on a prefix, the load's choice.
    assert decision.summary().startswith("latency:load match=0 ")
