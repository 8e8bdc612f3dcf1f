"""The compiled holder table and engine-hash map (router/native/blocktable.c, issue 24)
against their pure-Python twins: the same answers to long random mixed sequences of
stores in every tier, expiring records, removals, clears, clock steps and lookups, with
and without caps; and the compiled one's own edges (errors, many engines, set sharing).

The compiled helper is built by ``make venv``; where it is not (a install without a C
compiler), the pure paths are the only ones and this module has nothing to compare."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.events.ingest import hash_maps
from router.hashing import native_helper
from router.index.base import Match
from router.index.memory import COMPACT, MemoryIndex
from router.types import EngineKey, Tier

pytestmark = pytest.mark.skipif(not COMPACT, reason="the compiled helper is not built")

ENGINES = [EngineKey(f"10.0.0.{i}:8000") for i in range(6)]
POOL = [0, 1, 2, 3, 5, 8, 13, 2**63 - 1, 2**63, 2**64 - 1, *range(100, 130)]
"""Keys drawn from a small pool so that engines share them, the 64-bit edges included."""
_KEYS = st.lists(st.sampled_from(POOL), max_size=20)
_ENGINE = st.integers(0, len(ENGINES) - 1)
_TIER = st.sampled_from(list(Tier))
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), _ENGINE, _TIER, _KEYS),
        st.tuples(st.just("expiring"), _ENGINE, _KEYS, st.sampled_from([1.0, 5.0, 9.0])),
        st.tuples(st.just("remove"), _ENGINE, st.sampled_from([*Tier, None]), _KEYS),
        st.tuples(st.just("clear"), _ENGINE),
        st.tuples(st.just("tick"), st.sampled_from([0.5, 2.0, 6.0])),
        st.tuples(st.just("lookup"), _KEYS, st.lists(_ENGINE, max_size=6)),
    ),
    max_size=150,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _same_state(compact: MemoryIndex, pure: MemoryIndex, engines: list[EngineKey]) -> None:
    """The sizes, evictions and every engine's held keys of either index, compared."""
    a, b = compact.stats_now(), pure.stats_now()
    assert (a.blocks, a.entries, a.engines) == (b.blocks, b.entries, b.engines)
    assert a.evicted == b.evicted
    for engine in engines:
        for tier in Tier:
            assert compact.held_keys(engine, tier) == pure.held_keys(engine, tier)


def _same(compact: MemoryIndex, pure: MemoryIndex) -> None:
    """Everything either index answers, compared."""
    _same_state(compact, pure, ENGINES)
    probe = [k for k in POOL if k != 0]
    for start in range(0, len(probe), 7):
        keys = probe[start:]
        assert compact.lookup_now(keys, ENGINES) == pure.lookup_now(keys, ENGINES)


@settings(max_examples=200, deadline=None)
@given(_OPS, st.sampled_from([(0, 0), (0, 4), (12, 0), (10, 6)]))
async def test_the_compiled_table_answers_as_the_pure_one(
    ops: list[tuple], caps: tuple[int, int]
) -> None:
    clock = Clock()
    compact = MemoryIndex(clock, *caps, compact=True)
    pure = MemoryIndex(clock, *caps, compact=False)
    assert compact.compact and not pure.compact
    for op in ops:
        kind = op[0]
        for index in (compact, pure):
            if kind == "add":
                index.add_now(ENGINES[op[1]], op[3], op[2])
            elif kind == "expiring":
                index.add_now(ENGINES[op[1]], op[2], ttl=op[3])
            elif kind == "remove":
                index.remove_now(ENGINES[op[1]], op[3], op[2])
            elif kind == "clear":
                index.clear_now(ENGINES[op[1]])
        if kind == "tick":
            clock.now += op[1]
        elif kind == "lookup":
            candidates = [ENGINES[e] for e in op[2]]
            assert compact.lookup_now(op[1], candidates) == pure.lookup_now(op[1], candidates)
    _same(compact, pure)
    assert await compact.held_blocks() == await pure.held_blocks()


@pytest.mark.parametrize("caps", [(0, 0), (0, 300), (2_000, 0), (1_500, 400)])
def test_long_seeded_runs_grow_compact_and_evict_alike(caps: tuple[int, int]) -> None:
    """More engines and keys than the cases above, so that the compiled tables grow,
    squeeze out holes and evict many times over; compared along the way and at the end."""
    rng = random.Random(caps[0] * 7 + caps[1])
    engines = [EngineKey(f"10.3.0.{i}:8000") for i in range(70)]
    pool = [rng.getrandbits(64) for _ in range(3_000)]
    clock = Clock()
    compact = MemoryIndex(clock, *caps, compact=True)
    pure = MemoryIndex(clock, *caps, compact=False)
    for step in range(1_500):
        roll = rng.random()
        engine = engines[rng.randrange(len(engines))]
        start = rng.randrange(len(pool))
        keys = pool[start : start + rng.randint(0, 120)]
        for index in (compact, pure):
            if roll < 0.5:
                index.add_now(engine, keys, Tier([0, 0, 0, 1, 2][step % 5]))
            elif roll < 0.6:
                index.add_now(engine, keys, ttl=[1.0, 5.0][step % 2])
            elif roll < 0.8:
                index.remove_now(engine, keys, [None, Tier.GPU, Tier.CPU, Tier.DISK][step % 4])
            elif roll < 0.82:
                index.clear_now(engine)
        if 0.82 <= roll < 0.86:
            clock.now += 2.0
        elif roll >= 0.86:
            candidates = rng.sample(engines, rng.randint(1, len(engines)))
            assert compact.lookup_now(keys, candidates) == pure.lookup_now(keys, candidates)
    _same_state(compact, pure, engines)


def test_a_thousand_engines_along_shared_and_private_chains() -> None:
    """Holder sets large and small, changing along a prompt: depths, tiers and the
    candidates' filter as the pure table gives them."""
    rng = random.Random(7)
    engines = [EngineKey(f"10.1.{i // 250}.{i % 250}:8000") for i in range(1_000)]
    prompt = [rng.getrandbits(64) for _ in range(64)]
    compact = MemoryIndex(compact=True)
    pure = MemoryIndex(compact=False)
    for n, engine in enumerate(engines):
        depth = (n * 7) % 65
        private = [rng.getrandbits(64) for _ in range(20)]
        tier = Tier.CPU if n % 5 == 0 else Tier.GPU
        for index in (compact, pure):
            index.add_now(engine, prompt[:depth], tier)
            if n % 3 == 0:
                index.add_now(engine, prompt[: depth // 2], Tier.DISK)
            index.add_now(engine, private)
    for candidates in (engines, engines[::3], engines[500:520], engines[:1]):
        got = compact.lookup_now(prompt, candidates)
        assert got == pure.lookup_now(prompt, candidates)
    assert len(compact.lookup_now(prompt, engines)) == sum(1 for n in range(1_000) if (n * 7) % 65)
    for engine in engines[::10]:
        compact.clear_now(engine)
        pure.clear_now(engine)
    assert compact.lookup_now(prompt, engines) == pure.lookup_now(prompt, engines)
    assert compact.stats_now().entries == pure.stats_now().entries


def test_shared_blocks_share_one_holder_set() -> None:
    """32 engines holding the same 1,000 blocks make one holder set, not 1,000."""
    table = native_helper().BlockIndex()  # type: ignore[union-attr]
    keys = list(range(10_000, 11_000))
    for engine in range(32):
        table.add(engine, 0, keys)
        table.add(engine, 0, [engine * 1_000_000 + k for k in range(100)])  # its own
    blocks, entries, sets, size = table.stats()
    assert (blocks, entries) == (1_000 + 32 * 100, 32 * 1_100)
    assert sets <= 32 * 2 + 1  # per engine: its own singleton set (and the growing chain)
    assert table.holders(10_000) == [(e, 0) for e in range(32)]
    assert size < 64 * entries


def test_candidate_ids_are_cached_by_identity_until_an_id_is_retired() -> None:
    """The compiled lookup caches each candidate object's engine id (hashing 1,000
    EngineKey tuples was most of a lookup): an engine added later is still found, and
    once an engine is cleared and its id reused by another, the cleared one's object no
    longer resolves to it. Equal objects that are not the cached ones resolve too."""
    index = MemoryIndex(compact=True)
    a, b, c = EngineKey("10.9.0.1:8000"), EngineKey("10.9.0.2:8000"), EngineKey("10.9.0.3:8000")
    index.add_now(a, [1, 2, 3])
    assert index.lookup_now([1, 2, 3], [a, b]) == {a: Match(3)}
    index.add_now(b, [1, 2])  # not known at the first lookup: nothing stale cached
    assert index.lookup_now([1, 2, 3], [a, b]) == {a: Match(3), b: Match(2)}
    index.clear_now(a)
    index.add_now(c, [1])  # takes a's freed id
    assert index.lookup_now([1, 2, 3], [a, b, c]) == {b: Match(2), c: Match(1)}
    twin = EngineKey("10.9.0.2:8000")  # equal to b, another object
    assert twin is not b
    assert index.lookup_now([1, 2, 3], [twin]) == {b: Match(2)}
    table = native_helper().BlockIndex()  # type: ignore[union-attr]
    table.add(0, 0, [1])
    with pytest.raises(TypeError):
        table.lookup([1], ["a"], {"a": 0}, ["a"], Match, "not a generation")


def test_bad_keys_tiers_and_engine_ids_are_refused() -> None:
    table = native_helper().BlockIndex()  # type: ignore[union-attr]
    with pytest.raises(OverflowError):
        table.add(0, 0, [-1])
    with pytest.raises(OverflowError):
        table.add(0, 0, [2**64])
    with pytest.raises(TypeError):
        table.add(0, 0, ["x"])
    with pytest.raises(ValueError):
        table.add(0, 3, [1])
    with pytest.raises(ValueError):
        table.add(-1, 0, [1])
    with pytest.raises(ValueError):
        native_helper().BlockIndex(-1, 0)  # type: ignore[union-attr]
    with pytest.raises(OverflowError):
        table.add_expiring(0, [5, -1], 1.0)
    assert table.stats()[:2] == (0, 0)  # nothing half-applied before the bad key
    assert table.holders(5) == []
    table.add(0, 0, [1, 2])
    assert table.lookup([1, 2], ["a"], {"a": 0}, ["a"], Match) == {"a": Match(2)}
    with pytest.raises(OverflowError):
        table.lookup([1, -2], ["a"], {"a": 0}, ["a"], Match)


def test_expiring_records_are_compact_and_swept_by_deadline() -> None:
    """Provisional records (one per block of every routed request, for
    ``policy.provisional_ttl_s``) cost tens of bytes each, not a dict per key."""
    table = native_helper().BlockIndex()  # type: ignore[union-attr]
    before = table.stats()[3]
    for request in range(100):
        table.add_expiring(request % 8, list(range(request * 200, request * 200 + 200)), 10.0)
    assert table.expiring == 20_000 and table.next_deadline == 10.0
    assert (table.stats()[3] - before) / table.expiring < 100
    table.add_expiring(0, [0, 1], 20.0)  # a later add moves these two later
    table.add_expiring(1, [201], 5.0)  # and this one earlier
    table.sweep(5.0)
    assert table.expiring == 19_999 and table.holders(201) == []
    table.sweep(10.0)
    assert table.expiring == 2 and table.holders(0) == [(0, 3)] and table.holders(2) == []
    assert table.next_deadline == 20.0
    table.clear(0)
    assert table.expiring == 0 and table.holders(0) == []


# ------------------------------------------------------------------ the engine-hash map

_MAP_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.lists(st.sampled_from(POOL), max_size=12), st.booleans()),
        st.tuples(st.just("pop"), st.sampled_from(POOL)),
        st.tuples(st.just("oldest"), st.integers(0, 8)),
        st.tuples(st.just("set"), st.sampled_from(POOL), st.sampled_from(POOL)),
        st.tuples(st.just("clear")),
    ),
    max_size=120,
)


@settings(max_examples=200, deadline=None)
@given(_MAP_OPS)
def test_the_compiled_map_answers_as_an_ordered_dict(ops: list[tuple]) -> None:
    mine = native_helper().BlockMap()  # type: ignore[union-attr]
    ref: OrderedDict[int, int] = OrderedDict()
    for op in ops:
        if op[0] == "store":
            values = [(h * 31) % 2**64 for h in op[1]]
            mine.store(op[1], values, op[2])
            if op[2]:  # as router.index.base.store_newest: all popped, then stored
                for h in op[1]:
                    ref.pop(h, None)
            for h, v in zip(op[1], values, strict=True):
                ref[h] = v
        elif op[0] == "pop":
            assert mine.pop(op[1], None) == ref.pop(op[1], None)
        elif op[0] == "oldest":
            gone = [ref.popitem(last=False)[1] for _ in range(min(op[1], len(ref)))]
            assert mine.pop_oldest(op[1]) == gone
        elif op[0] == "set":
            mine[op[1]] = op[2]
            ref[op[1]] = op[2]
        else:
            mine.clear()
            ref.clear()
        assert len(mine) == len(ref)
    assert list(mine) == list(ref) and mine.items() == list(ref.items())
    assert mine == dict(ref) and mine.values() == list(ref.values())
    for key in POOL:
        assert (key in mine) == (key in ref) and mine.get(key) == ref.get(key)


def test_the_map_takes_what_a_dict_takes_and_refuses_what_it_cannot_hold() -> None:
    mine = hash_maps()[0]
    assert type(mine).__name__ == "BlockMap"
    mine.update({1: 10, 2: 20})
    mine.update([(3, 30)])
    other = hash_maps()[0]
    other.update(mine)
    assert other == {1: 10, 2: 20, 3: 30} and other == mine
    assert mine[2] == 20 and "x" not in mine and mine.get("x", 5) == 5
    del mine[2]
    with pytest.raises(KeyError):
        mine[2]
    with pytest.raises(KeyError):
        mine.pop(2)
    with pytest.raises(OverflowError):
        mine[-1] = 1
    assert dict(mine) == {1: 10, 3: 30}
    assert mine.__sizeof__() > 0
