"""The load a plan's legs charge (router/serving/charges.py), and every caller taking it
from there: a gateway's pick, the HTTP prefill leg, each handoff dialect and the
simulator open the tickets the rule says, no more and no other."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from router.config import DisaggregationConfig, PolicyConfig
from router.engine_model import EngineParams
from router.fleet.load import LoadTracker, Ticket
from router.flow.ticket import FlowTicket
from router.handoff import registry as dialects
from router.plan import Plan
from router.policy.base import Decision, RouteRequest
from router.policy.disagg import SplitDecision
from router.proxy import UpstreamError
from router.serving.charges import Charges, LegCharge, decode_charge, prefill_charge
from router.serving.context import Outcome
from router.serving.forward import Forwarder
from router.serving.picks import PickLedger
from router.serving.split import PDForwarder
from router.sim import cluster
from router.sim.cluster import ClusterSim, Fleet, SimSettings
from router.types import EngineKey
from router.workloads.generated import shared_prefix_workload

D, P, ELSEWHERE = (
    EngineKey("10.0.0.1:8000", 0),
    EngineKey("10.0.0.9:8000", 0),
    EngineKey("10.0.0.2:8000", 0),
)
FLOW = FlowTicket("tenant", 0)

#: What one ``LoadTracker.begin`` was asked: engine, prompt, cached, max tokens, flow,
#: sees_first_token, timed.
Begun = tuple[EngineKey, int, int, int, FlowTicket | None, bool, bool | None]


class Recording(LoadTracker):
    """A load tracker that remembers every ticket it was asked to open."""

    begun: list[Begun]

    def begin(
        self,
        engine: EngineKey,
        prompt_tokens: int,
        cached_tokens: int,
        max_tokens: int,
        flow: FlowTicket | None = None,
        *,
        sees_first_token: bool = True,
        timed: bool | None = None,
    ) -> Ticket:
        self.begun.append(
            (engine, prompt_tokens, cached_tokens, max_tokens, flow, sees_first_token, timed)
        )
        return super().begin(
            engine,
            prompt_tokens,
            cached_tokens,
            max_tokens,
            flow,
            sees_first_token=sees_first_token,
            timed=timed,
        )


def recording() -> Recording:
    loads = Recording(16)
    loads.begun = []
    return loads


def asked(charge: LegCharge, sees_first_token: bool = True) -> Begun:
    """The ``begin`` a charge stands for."""
    return (
        charge.engine,
        charge.prompt_tokens,
        charge.cached_tokens,
        charge.max_tokens,
        charge.flow,
        sees_first_token,
        charge.timed,
    )


def plan(*, split: bool, n: int = 1) -> Plan:
    route = RouteRequest("r1", [1, 2, 3], prompt_tokens=64, block_size=16, max_tokens=32)
    route.flow = FLOW
    decode = Decision(D, "kv_cost", "no_prefix", cached_tokens=16)
    if not split:
        return Plan("m", route, decode, load_tokens=64 * n)
    return Plan(
        "m",
        route,
        decode,
        load_tokens=64 * n,
        split=SplitDecision(True, "split", 48, 0.001, 0.002),
        prefill=Decision(P, "kv_cost", "prefix_hit", cached_tokens=32),
        dialect="nixl",
    )


# ------------------------------------------------------------------------------ the rule


def test_an_aggregated_plan_charges_one_engine_with_its_cache_and_the_flow() -> None:
    charges = Charges.of(plan(split=False, n=2))
    assert charges.prefill is None
    assert charges.decode == LegCharge(D, 128, 16, 32, FLOW, None)


def test_a_split_decode_leg_counts_all_but_the_last_prompt_token_as_cached() -> None:
    decode = Charges.of(plan(split=True, n=2)).decode
    assert decode == LegCharge(D, 128, 63, 32, None, timed=False)


def test_a_split_prefill_leg_prefills_the_prompt_for_one_token_and_carries_the_flow() -> None:
    assert Charges.of(plan(split=True)).prefill == LegCharge(P, 64, 32, 1, FLOW)


def test_a_retried_prefill_engine_is_charged_by_the_same_rule() -> None:
    route = plan(split=True).route
    other = Decision(ELSEWHERE, "kv_cost", "no_prefix", cached_tokens=0)
    assert prefill_charge(route, other) == LegCharge(ELSEWHERE, 64, 0, 1, FLOW)


def test_an_empty_prompt_split_counts_nothing_cached() -> None:
    route = RouteRequest("r0", [], prompt_tokens=0, block_size=16, max_tokens=8)
    decode = Decision(D, "kv_cost", "no_prefix", cached_tokens=0)
    assert decode_charge(route, decode, 0, split=True).cached_tokens == 0


def test_the_prefill_ticket_opens_before_the_decode_ticket() -> None:
    loads = recording()
    charges = Charges.of(plan(split=True))
    decode, prefill = charges.begin(loads)
    assert prefill is not None and prefill.id < decode.id
    assert loads.begun == [asked(charges.prefill), asked(charges.decode)]  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ gateways


@pytest.mark.parametrize("split", [False, True], ids=["aggregated", "split"])
def test_a_pick_opens_its_plans_charges_without_seeing_the_first_token(split: bool) -> None:
    loads = recording()
    planned = plan(split=split)
    PickLedger(loads, ttl_s=10).hold(planned)
    charges = Charges.of(planned)
    legs = [charges.prefill, charges.decode] if split else [charges.decode]
    assert loads.begun == [asked(leg, sees_first_token=False) for leg in legs if leg]


@pytest.mark.parametrize("split", [False, True], ids=["aggregated", "split"])
def test_a_pick_served_elsewhere_charges_its_decode_leg_there_with_nothing_cached(
    split: bool,
) -> None:
    loads = recording()
    ledger = PickLedger(loads, ttl_s=10)
    planned = plan(split=split)
    ledger.move(ledger.hold(planned), ELSEWHERE)
    decode = Charges.of(planned).decode
    moved = LegCharge(
        ELSEWHERE, decode.prompt_tokens, 0, decode.max_tokens, decode.flow, decode.timed
    )
    assert loads.begun[-1] == asked(moved, sees_first_token=False)


# ------------------------------------------------------------------- the router's own legs


class Anything:
    """Metrics nobody reads here: every attribute and call is accepted."""

    def __getattr__(self, name: str) -> Anything:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Anything:
        return self


ENGINE = SimpleNamespace(url="http://10.0.0.9:8000", bootstrap_port=8998, dp_size=1)


def context(planned: Plan) -> SimpleNamespace:
    return SimpleNamespace(
        request=planned.route,
        request_id=planned.route.request_id,
        model=planned.model,
        payload={"model": "m", "prompt": "hello", "max_tokens": 32},
        body=b"{}",
        path="/v1/completions",
        parsed=SimpleNamespace(stream=False, include_usage=False),
        sink=SimpleNamespace(headers={}),
        outcome=Outcome(),
    )


class StubLegs:
    """The router's side of a handoff (:class:`~router.handoff.base.Legs`), recording
    what each leg was asked to charge; engines answer at once."""

    def __init__(self) -> None:
        self.metrics = Anything()
        self.loads = recording()
        self.disaggregation = DisaggregationConfig()
        self.engine_cidrs: list[str] = []
        self.prefills: list[Decision] = []
        self.decode_cached: list[int | None] = []

    def engine(self, key: EngineKey) -> SimpleNamespace:
        return ENGINE

    async def prefill_leg(
        self, ctx: Any, prefill: Decision, body: bytes
    ) -> tuple[int, dict[str, Any]]:
        self.prefills.append(prefill)
        return 200, {"kv_transfer_params": {"do_remote_prefill": True}}

    async def decode_leg(self, ctx: Any, decode: Decision, body: bytes, **kw: Any) -> None:
        self.decode_cached.append(kw.get("cached_tokens"))

    async def another_prefill(self, *args: Any) -> Decision | None:
        return None

    async def local(self, ctx: Any, decode: Decision, reason: str) -> None:
        raise AssertionError(f"served locally: {reason}")

    async def refused(self, ctx: Any, status: int, answer: dict[str, Any]) -> None:
        raise AssertionError(f"refused: {status}")


@pytest.mark.parametrize("dialect", ["nixl", "sglang", "sidecar"])
def test_each_dialects_decode_leg_counts_the_plans_decode_charge(dialect: str) -> None:
    planned = plan(split=True)
    legs = StubLegs()
    asyncio.run(dialects.get(dialect).serve(context(planned), planned, legs))  # type: ignore[arg-type]
    assert legs.decode_cached == [Charges.of(planned).decode.cached_tokens]


@pytest.mark.parametrize("dialect", ["nixl", "sglang"])
def test_dialects_that_run_the_prefill_leg_send_it_to_the_planned_engine(dialect: str) -> None:
    planned = plan(split=True)
    legs = StubLegs()
    asyncio.run(dialects.get(dialect).serve(context(planned), planned, legs))  # type: ignore[arg-type]
    assert legs.prefills == [planned.prefill]


def test_the_sidecar_dialect_holds_the_plans_prefill_charge_until_the_answer() -> None:
    planned = plan(split=True)
    legs = StubLegs()
    asyncio.run(dialects.get("sidecar").serve(context(planned), planned, legs))  # type: ignore[arg-type]
    assert legs.loads.begun == [asked(Charges.of(planned).prefill)]  # type: ignore[arg-type]
    assert legs.loads.in_flight == 0


def test_the_http_prefill_leg_opens_the_prefill_charge_of_its_engine() -> None:
    loads = recording()

    async def unreachable(*args: Any) -> None:
        raise UpstreamError("connect", "refused")

    app = SimpleNamespace(
        metrics=Anything(),
        core=SimpleNamespace(loads=loads),
        registry=SimpleNamespace(engine_of=lambda key: ENGINE, record_failure=lambda e: None),
        upstream=SimpleNamespace(open=unreachable),
        credentials=SimpleNamespace(upstream_authorization_of=lambda *a: None),
    )
    legs = PDForwarder(Forwarder(app))  # type: ignore[arg-type]
    planned = plan(split=True)
    other = Decision(ELSEWHERE, "kv_cost", "no_prefix", cached_tokens=8)
    for prefill in (planned.prefill, other):
        assert prefill is not None
        with pytest.raises(UpstreamError):
            asyncio.run(legs.prefill_leg(context(planned), prefill, b"{}"))  # type: ignore[arg-type]
    assert loads.begun == [
        asked(prefill_charge(planned.route, planned.prefill)),  # type: ignore[arg-type]
        asked(prefill_charge(planned.route, other)),
    ]
    assert loads.in_flight == 0


# ------------------------------------------------------------------------------ simulator


@pytest.fixture
def sim_loads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Recording]]:
    """Every load tracker the simulator builds, recording."""
    made: list[Recording] = []

    def make(*args: Any, **kwargs: Any) -> Recording:
        loads = Recording(*args, **kwargs)
        loads.begun = []
        made.append(loads)
        return loads

    monkeypatch.setattr(cluster, "LoadTracker", make)
    yield made


@pytest.mark.parametrize(
    "fleet", [Fleet(engines=2), Fleet(prefill=2, decode=2)], ids=["aggregated", "split"]
)
def test_the_simulator_opens_each_plans_charges(fleet: Fleet, sim_loads: list[Recording]) -> None:
    settings = SimSettings(
        fleet,
        EngineParams(num_gpu_blocks=4_096, max_model_len=16_384),
        PolicyConfig(name="round_robin"),
        DisaggregationConfig(min_uncached_tokens=16),
    )
    sim = ClusterSim(settings)
    planner = sim.planner
    plans: list[Plan] = []
    plan_of = planner.plan

    async def recorded(*args: Any, **kwargs: Any) -> Plan:
        plans.append(await plan_of(*args, **kwargs))
        return plans[-1]

    planner.plan = recorded  # type: ignore[method-assign]
    asyncio.run(sim.run(shared_prefix_workload(2, 3, 400, 20, 8, seed=1)))
    expected = []
    for planned in plans:
        charges = Charges.of(planned)
        expected += [asked(leg) for leg in (charges.prefill, charges.decode) if leg is not None]
    assert sim_loads[0].begun == expected
    assert any(p.prefill is not None for p in plans) == fleet.disaggregated
