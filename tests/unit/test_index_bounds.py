"""The in-memory index's memory bounds (issue 24): ``index.max_entries_per_engine`` and
``index.max_entries`` evict the least recently stored records, and the event stream's
engine-hash maps are bounded alike. A reference model checks the index over long
random sequences of stores, removals, clears and lookups."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config import IndexConfig
from router.events.ingest import EventIngestor, StreamState
from router.events.types import BlockRemoved, BlockStored, EventBatch
from router.index import index_from_config
from router.index.base import Match
from router.index.memory import COMPACT, MemoryIndex
from router.types import EngineKey, Tier

ENGINES = [EngineKey(f"10.0.0.{i}:8000") for i in range(4)]
TABLES = [False, True] if COMPACT else [False]
"""Holder tables every test runs on: the pure-Python one, and the compiled one where it
is built (``make venv`` builds it)."""
TIERS = [Tier.GPU, Tier.CPU, Tier.DISK]


def trimmed(cap: int) -> int:
    return min(cap - cap // 8, cap - 1)


class Reference:
    """What the index should hold: per (engine, tier) the keys, oldest stored first."""

    def __init__(self, per_engine: int) -> None:
        self.per_engine = per_engine
        self.held: dict[tuple[EngineKey, Tier], OrderedDict[int, None]] = {}
        self.evicted = 0

    def add(self, engine: EngineKey, keys: list[int], tier: Tier) -> None:
        held = self.held.setdefault((engine, tier), OrderedDict())
        if self.per_engine:
            for key in keys:
                held.pop(key, None)
        for key in keys:
            held.setdefault(key, None)
        cap = self.per_engine
        if cap and len(held) > cap:
            for _ in range(len(held) - trimmed(cap)):
                held.popitem(last=False)
                self.evicted += 1

    def remove(self, engine: EngineKey, keys: list[int], tier: Tier | None) -> None:
        for t in TIERS if tier is None else [tier]:
            held = self.held.get((engine, t), OrderedDict())
            for key in keys:
                held.pop(key, None)

    def clear(self, engine: EngineKey) -> None:
        for t in TIERS:
            self.held.pop((engine, t), None)

    def lookup(self, keys: list[int], candidates: list[EngineKey]) -> dict[EngineKey, Match]:
        out: dict[EngineKey, Match] = {}
        for engine in dict.fromkeys(candidates):
            tiers = [self.held.get((engine, t), {}) for t in TIERS]
            depth = 0
            while depth < len(keys) and any(keys[depth] in h for h in tiers):
                depth += 1
            if depth:
                off = [k for k in keys[:depth] if k not in tiers[0]]
                disk = [k for k in off if k not in tiers[1]]
                out[engine] = Match(depth, len(off), len(disk))
        return out

    def entries(self) -> int:
        return sum(len(h) for h in self.held.values())


_KEYS = st.lists(st.integers(0, 40), max_size=24)
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 3), st.sampled_from(TIERS), _KEYS),
        st.tuples(st.just("remove"), st.integers(0, 3), st.sampled_from([*TIERS, None]), _KEYS),
        st.tuples(st.just("clear"), st.integers(0, 3)),
        st.tuples(st.just("lookup"), _KEYS, st.lists(st.integers(0, 3), max_size=4)),
    ),
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(_OPS, st.sampled_from([0, 1, 3, 8, 16]), st.sampled_from(TABLES))
def test_the_index_matches_a_reference_model_under_a_per_engine_cap(
    ops: list[tuple], cap: int, compact: bool
) -> None:
    index = MemoryIndex(max_entries_per_engine=cap, compact=compact)
    ref = Reference(cap)
    for op in ops:
        if op[0] == "add":
            _, e, tier, keys = op
            index.add_now(ENGINES[e], keys, tier)
            ref.add(ENGINES[e], keys, tier)
        elif op[0] == "remove":
            _, e, tier, keys = op
            index.remove_now(ENGINES[e], keys, tier)
            ref.remove(ENGINES[e], keys, tier)
        elif op[0] == "clear":
            index.clear_now(ENGINES[op[1]])
            ref.clear(ENGINES[op[1]])
        else:
            _, keys, candidates = op
            engines = [ENGINES[c] for c in candidates]
            assert index.lookup_now(keys, engines) == ref.lookup(keys, engines)
        assert index._table.entries == ref.entries() == index.stats_now().entries
    assert index.evicted["engine_cap"] == ref.evicted
    for e in ENGINES:
        assert index.lookup_now(list(range(41)), [e]) == ref.lookup(list(range(41)), [e])


@pytest.mark.parametrize("compact", TABLES)
def test_an_engine_over_its_cap_loses_its_least_recently_stored_blocks(compact: bool) -> None:
    index = MemoryIndex(max_entries_per_engine=64, compact=compact)
    a, b = ENGINES[:2]
    index.add_now(b, list(range(10)))
    index.add_now(a, list(range(64)))
    index.add_now(a, [0])  # stored again: now the most recent
    index.add_now(a, [1000])  # 65 > 64: the oldest eighth (9 records) goes
    held = index.held_keys(a)
    assert len(held) == 56 == trimmed(64)
    assert list(held)[:2] == [10, 11] and list(held)[-2:] == [0, 1000]
    assert index.evicted == {"engine_cap": 9}
    # a keeps 0 (stored again) but lost 1..9
    assert index.lookup_now(list(range(10)), [a, b]) == {a: Match(1), b: Match(10)}
    assert index.stats_now().evicted == {"engine_cap": 9}


@pytest.mark.parametrize("compact", TABLES)
def test_a_flooding_engine_is_evicted_first_when_the_index_is_full(compact: bool) -> None:
    index = MemoryIndex(max_entries=1_000, compact=compact)
    quiet = ENGINES[:3]
    for n, engine in enumerate(quiet):
        index.add_now(engine, list(range(n * 100, n * 100 + 100)))
    rogue = ENGINES[3]
    for start in range(10_000, 20_000, 50):  # 10x the index's cap, in batches
        index.add_now(rogue, list(range(start, start + 50)))
        assert index.stats_now().entries <= 1_000
    for n, engine in enumerate(quiet):  # the quiet engines keep all they hold
        keys = list(range(n * 100, n * 100 + 100))
        assert index.lookup_now(keys, [engine]) == {engine: Match(100)}
    rogue_held = index.held_keys(rogue)
    assert rogue_held[-1] == 19_999 and rogue_held == sorted(rogue_held)  # the newest stay
    assert 500 < len(rogue_held) <= 700
    assert index.evicted["index_cap"] == 10_000 - len(rogue_held)
    assert "engine_cap" not in index.evicted


@pytest.mark.parametrize("compact", TABLES)
def test_the_largest_engine_and_tier_gives_way_and_every_cap_holds(compact: bool) -> None:
    index = MemoryIndex(max_entries=300, max_entries_per_engine=200, compact=compact)
    for round_ in range(40):
        for n, engine in enumerate(ENGINES):
            tier = TIERS[(n + round_) % 3]
            base = 1_000_000 * n + 1_000 * round_
            index.add_now(engine, list(range(base, base + 10 * (n + 1))), tier)
            assert index.stats_now().entries <= 300
            for e in ENGINES:
                assert all(len(index.held_keys(e, t)) <= 200 for t in TIERS)
    assert index.evicted["index_cap"] > 0
    assert index._table.entries == index.stats_now().entries


@pytest.mark.parametrize("compact", TABLES)
def test_unbounded_by_default_and_caps_must_not_be_negative(compact: bool) -> None:
    index = MemoryIndex(compact=compact)
    index.add_now(ENGINES[0], list(range(50_000)))
    assert index.stats_now().entries == 50_000 and not index.evicted
    with pytest.raises(ValueError):
        MemoryIndex(max_entries=-1, compact=compact)
    built = index_from_config(IndexConfig(max_entries=10, max_entries_per_engine=4))
    assert isinstance(built, MemoryIndex)
    assert (built.max_entries, built.max_entries_per_engine) == (10, 4)
    assert IndexConfig().max_entries_per_engine == 1_048_576 and IndexConfig().max_entries == 0


# ------------------------------------------------------------- the engine-hash maps


def _stored(hashes: list[int], parent: int | None, block_size: int = 4) -> BlockStored:
    tokens = [h % 1000 for h in hashes for _ in range(block_size)]
    return BlockStored(hashes, parent, tokens, block_size, medium="GPU")


@pytest.mark.parametrize("compact", TABLES)
async def test_a_streams_hash_map_is_bounded_and_forgets_its_oldest(compact: bool) -> None:
    index = MemoryIndex(max_entries_per_engine=32, compact=compact)
    ingestor = EventIngestor(index, max_blocks_per_engine=32)
    state = StreamState(ENGINES[0], "m", 4)
    parent = None
    for start in range(0, 320, 8):  # 10x the cap, as chained batches of 8 blocks
        hashes = list(range(start + 1, start + 9))
        await ingestor.apply(state, EventBatch(0.0, [_stored(hashes, parent)]))
        parent = hashes[-1]
        assert len(state.hashes[Tier.GPU]) <= 32
        assert index.stats_now().entries <= 32
    assert ingestor.counters.blocks_stored == 320
    assert ingestor.counters.forgotten_hashes == 320 - len(state.hashes[Tier.GPU])
    assert list(state.hashes[Tier.GPU])[-1] == 320  # the newest stay
    # The map and the index forget the same blocks: the newest are still removable.
    held = set(state.hashes[Tier.GPU])
    await ingestor.apply(state, EventBatch(0.0, [BlockRemoved(sorted(held), medium="GPU")]))
    assert index.stats_now().entries == 0
    # A removal of a forgotten hash is counted, not applied.
    await ingestor.apply(state, EventBatch(0.0, [BlockRemoved([1], medium="GPU")]))
    assert ingestor.counters.skipped["unknown_hash"] == 1


async def test_blocks_whose_hashes_are_forgotten_leave_the_index() -> None:
    """The map's bound holds even over an index without caps: what the router could no
    longer remove is removed now, so the index holds nothing stale."""
    index = MemoryIndex()
    ingestor = EventIngestor(index, max_blocks_per_engine=32)
    state = StreamState(ENGINES[0], "m", 4)
    for start in range(0, 320, 8):
        hashes = list(range(start + 1, start + 9))
        await ingestor.apply(state, EventBatch(0.0, [_stored(hashes, None)]))
        assert index.stats_now().entries == len(state.hashes[Tier.GPU]) <= 32
    assert not index.evicted  # removed with their hashes, not evicted
    newest = [k for k in state.hashes[Tier.GPU].values()]
    assert index.lookup_now(newest[-1:], [ENGINES[0]]) == {ENGINES[0]: Match(1)}


async def test_without_a_bound_the_map_keeps_every_hash() -> None:
    ingestor = EventIngestor(MemoryIndex())
    state = StreamState(ENGINES[0], "m", 4)
    await ingestor.apply(state, EventBatch(0.0, [_stored(list(range(1, 2_001)), None)]))
    assert len(state.hashes[Tier.GPU]) == 2_000 and ingestor.counters.forgotten_hashes == 0


def test_the_footprint_counts_each_object_once_and_grows_with_the_entries() -> None:
    index = MemoryIndex(compact=False)
    empty = index.footprint()
    keys = list(range(10**12, 10**12 + 5_000))  # ints too large to be the interpreter's
    index.add_now(ENGINES[0], keys)
    one = index.footprint()
    index.add_now(ENGINES[1], keys)  # the same key objects, one more engine
    two = index.footprint()
    assert one - empty > 5_000 * (28 + 24)  # each key's int and its two dict slots
    assert two - one < one - empty  # shared keys are not counted again
    seen: set[int] = set()
    assert index.footprint(seen) == two and index.footprint(seen) < 1_000  # all seen
