"""The pick ledger: tickets a pick holds, release, expiry, fallback moves."""

from __future__ import annotations

import pytest

from router.fleet.load import LoadTracker
from router.plan import Plan
from router.policy.base import Decision, RouteRequest
from router.policy.disagg import SplitDecision
from router.serving.picks import DuplicatePick, PickLedger
from router.types import EngineKey

A, B, P = (
    EngineKey("10.0.0.1:8000", 0),
    EngineKey("10.0.0.2:8000", 0),
    EngineKey("10.0.0.9:8000", 0),
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def plan(request_id: str, *, split: bool = False) -> Plan:
    route = RouteRequest(request_id, [1, 2, 3], prompt_tokens=64, block_size=16, max_tokens=32)
    decode = Decision(A, "kv_cost", "no_prefix", cached_tokens=16)
    if not split:
        return Plan("m", route, decode, load_tokens=64)
    return Plan(
        "m",
        route,
        decode,
        load_tokens=64,
        split=SplitDecision(True, "split", 48, 0.001, 0.002),
        prefill=Decision(P, "kv_cost", "prefix_hit", cached_tokens=32),
    )


def test_a_pick_counts_like_the_request_it_stands_for() -> None:
    loads = LoadTracker(16)
    ledger = PickLedger(loads, ttl_s=10, clock=Clock())
    ledger.hold(plan("r1"))
    assert loads.view[A].requests == 1
    assert loads.view[A].prefill_tokens == 64 - 16
    assert loads.view[A].decode_tokens == 32
    assert ledger.release("r1") is not None
    assert loads.in_flight == 0 and loads.view[A].requests == 0
    assert ledger.release("r1") is None
    assert ledger.counters.ended == {"released": 1}


def test_a_split_pick_holds_a_prefill_leg_and_a_decode_leg_that_pulls_its_kv() -> None:
    loads = LoadTracker(16)
    ledger = PickLedger(loads, ttl_s=10, clock=Clock())
    lease = ledger.hold(plan("r1", split=True))
    assert loads.view[P].prefill_tokens == 64 - 32
    assert loads.view[A].prefill_tokens == 1  # all but the last prompt token are pulled
    ledger.prefilled(lease)
    assert loads.view[P].requests == 0 and loads.view[A].prefill_tokens == 0
    assert loads.view[A].requests == 1 and loads.view[A].decode_blocks > 0
    ledger.end(lease, "released")
    assert loads.in_flight == 0 and loads.view[A].decode_blocks == 0


def test_picks_never_released_expire_after_the_ttl() -> None:
    clock = Clock()
    loads = LoadTracker(16)
    ledger = PickLedger(loads, ttl_s=10, clock=clock)
    ledger.hold(plan("old"))
    clock.now += 5
    ledger.hold(plan("new"))
    assert ledger.next_deadline() == 110
    clock.now += 5
    assert ledger.sweep(clock()) == 1
    assert ledger.get("old") is None and ledger.get("new") is not None
    assert loads.in_flight == 1
    clock.now += 5
    assert ledger.get("new") is None  # looking one up sweeps too
    assert ledger.counters.ended == {"expired": 2} and ledger.open_count == 0


def test_one_open_pick_per_request_id() -> None:
    ledger = PickLedger(LoadTracker(16), ttl_s=10, clock=Clock())
    ledger.hold(plan("same"))
    with pytest.raises(DuplicatePick):
        ledger.hold(plan("same"))
    ledger.release("same")
    ledger.hold(plan("same"))


def test_stream_owned_picks_do_not_expire_and_end_once() -> None:
    clock = Clock()
    loads = LoadTracker(16)
    ledger = PickLedger(loads, ttl_s=1, clock=clock)
    lease = ledger.hold(plan("x"), register=False)
    ledger.hold(plan("x"), register=False)  # ids of gateway requests may repeat
    clock.now += 100
    assert ledger.sweep(clock()) == 0 and ledger.open_count == 2
    assert ledger.end(lease, "stream_end") == 100
    assert ledger.end(lease, "stream_end") == 0
    assert ledger.open_count == 1 and loads.in_flight == 1


def test_moving_to_the_served_engine_keeps_the_phase() -> None:
    loads = LoadTracker(16)
    ledger = PickLedger(loads, ttl_s=10, clock=Clock())
    lease = ledger.hold(plan("r"))
    ledger.prefilled(lease)
    ledger.move(lease, B)
    assert loads.view[A].requests == 0 and loads.view[A].decode_blocks == 0
    assert loads.view[B].requests == 1 and loads.view[B].prefill_tokens == 0
    assert loads.view[B].decode_blocks > 0 and lease.endpoint == B.endpoint
    ledger.end(lease, "released")
    assert loads.in_flight == 0
