"""The shadow of a router's recent decisions: what it answers while Redis is away."""

from __future__ import annotations

from router.index import Match
from router.index.shadow import DecisionShadow
from router.types import EngineKey

A, B, C = EngineKey("10.0.0.1:8000"), EngineKey("10.0.0.2:8000"), EngineKey("10.0.0.3:8000")
FLEET = [A, B, C]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def chain(start: int, n: int) -> list[int]:
    """Stand-ins for chained block keys: distinct per position and per prompt."""
    return list(range(start, start + n))


def test_a_recorded_prompt_matches_in_full() -> None:
    shadow = DecisionShadow(clock=Clock())
    keys = chain(1000, 100)
    shadow.record(A, keys, ttl=5)
    assert shadow.lookup(keys, FLEET) == {A: Match(100)}


def test_a_longer_prompt_matches_the_whole_recorded_one() -> None:
    # The last key of a decision is always indexed: its end is found exactly.
    shadow = DecisionShadow(clock=Clock())
    keys = chain(1000, 37)
    shadow.record(A, keys, ttl=5)
    assert shadow.lookup([*keys, *chain(5000, 60)], FLEET) == {A: Match(37)}


def test_a_partial_overlap_is_exact_to_within_the_stride() -> None:
    shadow = DecisionShadow(stride=16, clock=Clock())
    shadow.record(A, chain(1000, 100), ttl=5)
    depth = shadow.lookup([*chain(1000, 40), *chain(7000, 60)], FLEET)[A].blocks
    assert 40 - 16 < depth <= 40


def test_a_prefix_counts_for_the_engine_it_was_sent_to_last() -> None:
    shadow = DecisionShadow(clock=Clock())
    keys = chain(1000, 64)
    shadow.record(A, keys, ttl=5)
    shadow.record(B, keys, ttl=5)
    assert shadow.lookup(keys, FLEET) == {B: Match(64)}


def test_only_candidates_are_answered() -> None:
    shadow = DecisionShadow(clock=Clock())
    keys = chain(1000, 32)
    shadow.record(A, keys, ttl=5)
    assert shadow.lookup(keys, [B, C]) == {}


def test_decisions_older_than_the_window_are_forgotten() -> None:
    clock = Clock()
    shadow = DecisionShadow(window=60, clock=clock)
    keys = chain(1000, 32)
    shadow.record(A, keys, ttl=5)
    clock.now += 59
    assert shadow.lookup(keys, FLEET) == {A: Match(32)}  # past its TTL in Redis, still here
    clock.now += 2
    assert shadow.lookup(keys, FLEET) == {}
    assert len(shadow) == 0


def test_memory_is_bounded_by_keys_oldest_first() -> None:
    shadow = DecisionShadow(max_keys=100, clock=Clock())
    first, second, third = chain(1000, 40), chain(2000, 40), chain(3000, 40)
    for keys in (first, second, third):
        shadow.record(A, keys, ttl=5)
    assert shadow.lookup(first, FLEET) == {}
    assert shadow.lookup(second, FLEET) == {A: Match(40)}
    assert shadow.lookup(third, FLEET) == {A: Match(40)}


def test_live_decisions_are_those_whose_shared_record_has_not_expired() -> None:
    clock = Clock()
    shadow = DecisionShadow(clock=clock)
    shadow.record(A, chain(1000, 8), ttl=5)
    shadow.record(B, chain(2000, 8), ttl=120)
    clock.now += 10
    assert [d.engine for d in shadow.live()] == [B]


def test_forgetting_an_engine_drops_its_decisions() -> None:
    shadow = DecisionShadow(clock=Clock())
    shadow.record(A, chain(1000, 20), ttl=5)
    shadow.record(B, chain(2000, 20), ttl=5)
    shadow.forget(A)
    assert shadow.lookup(chain(1000, 20), FLEET) == {}
    assert shadow.lookup(chain(2000, 20), FLEET) == {B: Match(20)}
