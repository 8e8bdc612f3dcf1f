"""Reference policies that ignore the KV index, for comparison and simple fleets."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import xxhash

from router.fleet.load import LoadView, load_of
from router.index.base import Match
from router.policy.base import Decision, Policy, RouteRequest, request_rng, tiebreak
from router.types import EngineKey


def _queue(loads: LoadView, engine: EngineKey) -> tuple[float, float]:
    """Load as a (requests, engine-reported waiting) pair, lower is lighter."""
    load = load_of(loads, engine)
    return (load.requests, load.waiting or 0.0)


class RoundRobin(Policy):
    """Each request to the next candidate in turn."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[EngineKey],
        matches: Mapping[EngineKey, Match],
        loads: LoadView,
    ) -> Decision:
        engine = candidates[self._turn % len(candidates)]
        self._turn += 1
        return Decision(engine, self.name, "round_robin")


class RandomChoice(Policy):
    """A uniformly random candidate (seeded by the request id)."""

    name = "random"

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[EngineKey],
        matches: Mapping[EngineKey, Match],
        loads: LoadView,
    ) -> Decision:
        return Decision(request_rng(request.request_id).choice(candidates), self.name, "random")


class LeastLoaded(Policy):
    """The candidate with the fewest in-flight requests (then fewest reported waiting)."""

    name = "least_loaded"

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[EngineKey],
        matches: Mapping[EngineKey, Match],
        loads: LoadView,
    ) -> Decision:
        engine = min(candidates, key=lambda e: (*_queue(loads, e), tiebreak(request.request_id, e)))
        return Decision(engine, self.name, "least_loaded")


class PowerOfTwo(Policy):
    """The lighter of two random candidates."""

    name = "power_of_two"

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[EngineKey],
        matches: Mapping[EngineKey, Match],
        loads: LoadView,
    ) -> Decision:
        if len(candidates) == 1:
            return Decision(candidates[0], self.name, "only_candidate")
        a, b = request_rng(request.request_id).sample(list(candidates), 2)
        engine = a if _queue(loads, a) <= _queue(loads, b) else b
        return Decision(engine, self.name, "power_of_two")


class Session(Policy):
    """Consistent (rendezvous) hashing on a session key, so a session keeps its engine.

    The key is the request's session (``x-session-id`` header or ``user`` field); without
    one, the prompt's first block key, so prompts sharing a first block stay together.
    Adding or removing an engine moves only the sessions that hashed to it.
    """

    name = "session"

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[EngineKey],
        matches: Mapping[EngineKey, Match],
        loads: LoadView,
    ) -> Decision:
        if request.session:
            key, reason = request.session, "session"
        elif request.keys:
            key, reason = f"block:{request.keys[0]}", "first_block"
        else:
            key, reason = request.request_id, "no_session"
        engine = max(
            candidates, key=lambda e: xxhash.xxh3_64_intdigest(f"{key}\x00{e.label}".encode())
        )
        return Decision(engine, self.name, reason)
