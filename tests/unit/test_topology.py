"""Engine topology and link prices (router/topology.py), the split rules that use them
(router/policy/disagg.py), and the prefill choice's transfer term (router/plan.py)."""

from __future__ import annotations

import pytest

from router.config import ConfigError, DisaggregationConfig, PolicyConfig, load_config
from router.core import RoutingCore
from router.fleet.load import LoadTracker
from router.index.memory import MemoryIndex
from router.plan import Planner
from router.policy import make_decode_policy, make_policy
from router.policy.base import RouteRequest
from router.policy.disagg import decide_split
from router.topology import UNKNOWN, Topology, default_link, link_between, link_for, locality
from router.types import EngineKey

CFG = DisaggregationConfig()


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (Topology("n1", "r1", "z1"), Topology("n1", "r1", "z1"), "same_node"),
        (Topology("n1", "r1", "z1"), Topology("n2", "r1", "z1"), "same_rack"),
        (Topology("n1", "r1", "z1"), Topology("n2", "r2", "z1"), "same_zone"),
        (Topology("n1", "r1", "z1"), Topology("n2", "r1", "z2"), "cross_zone"),
        (Topology(rack="r1"), Topology(rack="r2"), "same_zone"),  # other racks: the spine
        (Topology(zone="z1"), Topology(zone="z1"), "same_zone"),
        (Topology(node="n1"), Topology(node="n2"), UNKNOWN),
        (Topology(rack="r1"), None, UNKNOWN),
        (None, None, UNKNOWN),
    ],
)
def test_locality_is_the_narrowest_domain_both_are_known_to_share(
    a: Topology | None, b: Topology | None, expected: str
) -> None:
    assert locality(a, b) == expected
    assert locality(b, a) == expected


def test_unknown_links_price_a_transfer_as_the_split_always_did() -> None:
    link = default_link(CFG)
    tokens = 3000
    before = tokens * CFG.kv_bytes_per_token / (CFG.transfer_bandwidth_gb_s * 1e9)
    assert link.transfer_s(tokens, CFG) == before + CFG.handoff_overhead_s
    assert link.fast_enough(CFG.model_copy(update={"min_link_bandwidth_gb_s": 1e6}))
    assert decide_split(4000, 0, True, CFG) == decide_split(4000, 0, True, CFG, link=link)


def test_each_locality_has_its_configured_price() -> None:
    cfg = load_config(
        None,
        {
            "disaggregation": {
                "links": {"same_rack": {"bandwidth_gb_s": 40, "min_uncached_tokens": 128}}
            }
        },
    ).disaggregation
    rack = link_between(Topology("a", "r"), Topology("b", "r"), cfg)
    assert (rack.locality, rack.bandwidth_gb_s, rack.min_uncached_tokens) == ("same_rack", 40, 128)
    assert link_for("same_zone", cfg).min_uncached_tokens == cfg.min_uncached_tokens
    faster = [link_for(k, CFG).transfer_s(4000, CFG) for k in ("same_node", "same_rack")]
    slower = [link_for(k, CFG).transfer_s(4000, CFG) for k in ("same_zone", "cross_zone")]
    assert faster[0] < faster[1] < slower[0] < slower[1]
    with pytest.raises(ConfigError, match="bandwidth_gb_s"):
        load_config(None, {"disaggregation": {"links": {"cross_zone": {"bandwidth_gb_s": 0}}}})


class TestSplitRules:
    def test_a_link_under_the_floor_never_splits(self) -> None:
        link = link_for("cross_zone", CFG)
        assert not link.fast_enough(CFG)
        d = decide_split(8000, 0, True, CFG, link=link)
        assert not d.split and d.reason == "slow_link" and d.link == "cross_zone"
        off = CFG.model_copy(update={"min_link_bandwidth_gb_s": 0.0})
        # Without the floor the cost model still refuses a 0.625 GB/s link.
        assert decide_split(8000, 0, True, off, link=link).reason == "transfer_costs_more"

    def test_a_prefill_pool_smaller_than_configured_is_not_split_to(self) -> None:
        cfg = CFG.model_copy(update={"min_prefill_engines": 3})
        assert decide_split(8000, 0, True, cfg, prefill_engines=2).reason == "prefill_pool_small"
        assert decide_split(8000, 0, True, cfg, prefill_engines=3).split

    def test_a_link_with_its_own_threshold_splits_shorter_prompts(self) -> None:
        node = link_for(
            "same_node",
            DisaggregationConfig.model_validate(
                {"links": {"same_node": {"min_uncached_tokens": 64}}}
            ),
        )
        assert decide_split(300, 0, True, CFG).reason == "short_uncached"
        assert decide_split(300, 0, True, CFG, link=node).split


class Pools:
    def __init__(self, engines: dict[str, tuple[str, Topology | None]]) -> None:
        self.engines = {EngineKey(e): v for e, v in engines.items()}

    def candidates(self, model: str, roles: tuple[str, ...] = ("both",), exclude=()):  # type: ignore[no-untyped-def]
        return [
            k
            for k, (role, _) in self.engines.items()
            if role in roles and k.endpoint not in exclude
        ]

    def is_disaggregated(self, model: str) -> bool:
        return True

    def models(self) -> list[str]:
        return ["m"]

    def topology_of(self, key: EngineKey) -> Topology | None:
        return self.engines[key][1]


def planner(pools: Pools, located: bool = True) -> Planner:
    config = PolicyConfig()
    policy = make_policy(config)
    core = RoutingCore(MemoryIndex(), policy, config, LoadTracker(block_size=16))
    decode = make_decode_policy(config, CFG, policy)
    return Planner(
        pools, core, decode, CFG, lambda m: "nixl", locate=pools.topology_of if located else None
    )


async def test_the_same_rack_prefill_engine_wins_among_equal_ones_and_says_so() -> None:
    pools = Pools(
        {
            "p-far:1": ("prefill", Topology("n1", "B", "z")),
            "p-near:1": ("prefill", Topology("n2", "A", "z")),
            "d:1": ("decode", Topology("n3", "A", "z")),
        }
    )
    for i in range(5):
        plan = await planner(pools).plan("m", RouteRequest(f"r{i}", [], 4000, 16), 4000)
        assert plan.prefill is not None and plan.prefill.engine == EngineKey("p-near:1")
        assert plan.split is not None and plan.split.link == "same_rack"
        assert "link=same_rack" in plan.decode.summary()
        assert "transfer=" in plan.prefill.summary()


async def test_without_topology_the_plan_is_what_it_always_was() -> None:
    engines = {"p1:1": ("prefill", None), "p2:1": ("prefill", None), "d:1": ("decode", None)}
    for i in range(5):
        route = RouteRequest(f"r{i}", [], 4000, 16)
        located = await planner(Pools(engines)).plan("m", route, 4000)
        plain = await planner(Pools(engines), located=False).plan(
            "m", RouteRequest(f"r{i}", [], 4000, 16), 4000
        )
        assert route.transfer_tokens is None
        assert located.prefill is not None and plain.prefill is not None
        assert located.prefill.engine == plain.prefill.engine
        assert located.decode.summary() == plain.decode.summary()
        assert located.split == plain.split and located.split.link == UNKNOWN


async def test_prefill_engines_behind_a_slow_link_are_no_candidates() -> None:
    pools = Pools(
        {
            "p-other-zone:1": ("prefill", Topology("n1", "C", "z2")),
            "p-zone:1": ("prefill", Topology("n2", "B", "z1")),
            "d:1": ("decode", Topology("n3", "A", "z1")),
        }
    )
    plans = [
        await planner(pools).plan("m", RouteRequest(f"r{i}", [], 4000, 16), 4000) for i in range(4)
    ]
    assert {p.prefill.engine.endpoint for p in plans if p.prefill} == {"p-zone:1"}


async def test_the_split_hands_its_transfers_on_without_writing_into_the_request() -> None:
    pools = Pools(
        {
            "p-other-zone:1": ("prefill", Topology("n1", "C", "z2")),
            "p-rack:1": ("prefill", Topology("n2", "A", "z1")),
            "d:1": ("decode", Topology("n3", "A", "z1")),
        }
    )
    route = RouteRequest("r0", [], 4000, 16)
    plan = await planner(pools).plan("m", route, 4000)
    assert route.transfer_tokens is None and route.transfer_s_per_token is None
    assert plan.transfers is not None
    assert set(plan.transfers.tokens) == {EngineKey("p-rack:1")}  # the other is too slow
    assert plan.transfers.s_per_token == CFG.prefill_s_per_token


async def test_a_retried_prefill_choice_weighs_the_same_transfers() -> None:
    pools = Pools(
        {
            "p-other-zone:1": ("prefill", Topology("n1", "C", "z2")),
            "p-rack-a:1": ("prefill", Topology("n2", "A", "z1")),
            "p-rack-b:1": ("prefill", Topology("n4", "A", "z1")),
            "d:1": ("decode", Topology("n3", "A", "z1")),
        }
    )
    plans = planner(pools)
    route = RouteRequest("r0", [], 4000, 16)
    plan = await plans.plan("m", route, 4000)
    assert plan.prefill is not None
    tried = {plan.prefill.engine.endpoint}
    again = await plans.prefill(route, "m", tried, plan.transfers)
    assert again is not None and again.engine.endpoint in {"p-rack-a:1", "p-rack-b:1"} - tried
    assert "transfer=" in again.summary()
    tried.add(again.engine.endpoint)
    assert await plans.prefill(route, "m", tried, plan.transfers) is None
    assert route.transfer_tokens is None
