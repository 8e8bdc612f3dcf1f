"""Peer replicas' load in the load view: totals for policies, own part for publishing."""

from __future__ import annotations

from router.config import PolicyConfig
from router.fleet.load import InFlight, LoadTracker
from router.fleet.shared_load import decode_load, encode_load
from router.policy import make_policy
from router.policy.base import RouteRequest
from router.types import EngineKey

A, B = EngineKey("10.0.0.1:8000"), EngineKey("10.0.0.2:8000", 1)


def test_peers_add_to_the_totals_and_leave_the_own_part_alone() -> None:
    tracker = LoadTracker(16)
    ticket = tracker.begin(A, prompt_tokens=320, cached_tokens=0, max_tokens=10)
    tracker.set_peers({A: InFlight(2, 1000, 50, 0)})
    load = tracker.view[A]
    assert (load.requests, load.prefill_tokens, load.decode_tokens) == (3, 1320, 60)
    assert tracker.own() == {A: InFlight(1, 320, 10, 0)}
    tracker.prefilled(ticket)
    tracker.set_peers({A: InFlight(1, 0, 20, 7)})
    assert (load.requests, load.prefill_tokens, load.decode_blocks) == (
        2,
        0,
        28,
    )  # 20 prompt + 1 output block, 7 peers
    tracker.end(ticket)
    tracker.set_peers({})  # the peers finished too
    assert (load.requests, load.prefill_tokens, load.decode_tokens, load.decode_blocks) == (
        0,
        0,
        0,
        0,
    )
    assert tracker.own() == {}


def test_published_load_round_trips() -> None:
    work = {A: InFlight(1, 2, 3, 4), B: InFlight(5, 6, 7, 8)}
    assert decode_load(encode_load(work)) == work
    assert decode_load(encode_load({})) == {}


def test_the_cost_policy_avoids_an_engine_loaded_by_peers() -> None:
    tracker = LoadTracker(16)
    tracker.set_peers({A: InFlight(4, 4096, 0, 0)})
    policy = make_policy(PolicyConfig())
    request = RouteRequest("r", [1, 2, 3], 48, 16)
    assert policy.choose(request, [A, B], {}, tracker.view).engine == B


def test_least_loaded_counts_peers_requests() -> None:
    tracker = LoadTracker(16)
    tracker.begin(B, 16, 0, 1)
    tracker.set_peers({A: InFlight(3, 0, 0, 0)})
    policy = make_policy(PolicyConfig(name="least_loaded"))
    assert policy.choose(RouteRequest("r", [], 1, 16), [A, B], {}, tracker.view).engine == B
