"""The embedded in-memory index (the default backend).

Engines get small integer ids (cleared engines' ids are reused) and a *holder table*
records which engines hold which block keys, in which tier: the compiled
``router._native.BlockIndex`` (router/native/blocktable.c: an open-addressing key table
of interned holder sets, about 30 bytes a record) where the helper is built, else its
pure-Python twin :class:`router.index.bitmask.BitmaskTable` (dicts of engine bitmasks);
tests hold the two equal, and ``KVROUTE_PURE_PYTHON=1`` picks the pure one.

Expiring holders (provisional and approximate-mode records) count as GPU holders; the
table keeps their deadlines and every read first sweeps out what has expired (a check
of the earliest deadline when nothing has), so lookups never test deadlines per key. A
firm record of the same (key, engine) outlives its expiring one.

Memory is bounded by ``max_entries`` (firm records in all) and ``max_entries_per_engine``
(firm records of one engine in one tier); 0 is no limit. Each engine's firmly held keys
per tier are kept in the order stored (a key stored again moves to the end), so the
least recently stored go first: past an engine's cap its oldest eighth goes; past the
index's cap the largest (engine, tier) loses its oldest eighth, until the index is back
to seven eighths of its cap. ``evicted`` counts records evicted, by cause.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from router.hashing import native_helper
from router.index.base import IndexStats, KVIndex, Match, footprint
from router.index.bitmask import EVERY_TIER, BitmaskTable
from router.types import EngineKey, Tier

__all__ = ["HolderTable", "MemoryIndex", "footprint", "holder_table"]


class HolderTable(Protocol):
    """What :class:`MemoryIndex` asks of a holder table (``BitmaskTable`` and the
    compiled ``BlockIndex`` both are one). Engines are ids; tiers ``Tier`` values, -1
    for all."""

    @property
    def entries(self) -> int: ...
    @property
    def expiring(self) -> int: ...
    @property
    def next_deadline(self) -> float: ...
    @property
    def evicted(self) -> tuple[int, int]: ...
    def add(self, idx: int, tier: int, keys: Sequence[int]) -> int: ...
    def add_expiring(self, idx: int, keys: Sequence[int], deadline: float) -> None: ...
    def sweep(self, now: float) -> None: ...
    def remove(self, idx: int, tier: int, keys: Sequence[int]) -> int: ...
    def clear(self, idx: int) -> int: ...
    def held(self, idx: int, tier: int) -> int: ...
    def held_keys(self, idx: int, tier: int) -> list[int]: ...
    def held_union(self, idx: int) -> int: ...
    def lookup(
        self,
        keys: Sequence[int],
        candidates: Sequence[Any],
        ids: dict[Any, int],
        names: list[Any],
        match: type[Match],
        generation: int | None = None,
    ) -> dict[Any, Match]: ...
    def stats(self) -> tuple[int, int, int, int]: ...


_COMPACT: Any = getattr(native_helper(), "BlockIndex", None)
COMPACT = _COMPACT is not None
"""Whether :class:`MemoryIndex` uses the compiled holder table by default."""


def holder_table(
    max_entries: int = 0, max_entries_per_engine: int = 0, compact: bool | None = None
) -> HolderTable:
    """A holder table: compiled when ``compact`` (an error where it is not built), pure
    Python when False, the compiled one where built when None."""
    if compact is None:
        compact = COMPACT
    if compact:
        if _COMPACT is None:
            raise RuntimeError("the compact index needs the compiled helper (router._native)")
        table: HolderTable = _COMPACT(max_entries, max_entries_per_engine)
        return table
    return BitmaskTable(max_entries, max_entries_per_engine)


class MemoryIndex(KVIndex):
    """The index held in this process."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = 0,
        max_entries_per_engine: int = 0,
        compact: bool | None = None,
    ) -> None:
        """``max_entries``: at most this many firm records in all; ``max_entries_per_engine``:
        of one engine in one tier (0: no limit; the module docstring says what goes).
        ``compact``: the compiled holder table (True), the pure-Python one (False), the
        compiled one where it is built (None)."""
        if max_entries < 0 or max_entries_per_engine < 0:
            raise ValueError("max_entries and max_entries_per_engine must be >= 0")
        self._clock = clock
        self.max_entries = max_entries
        self.max_entries_per_engine = max_entries_per_engine
        self._table = holder_table(max_entries, max_entries_per_engine, compact)
        self.compact = not isinstance(self._table, BitmaskTable)
        """Whether the compiled holder table is in use."""
        self._ids: dict[EngineKey, int] = {}
        self._names: list[EngineKey | None] = []
        self._free: list[int] = []
        self.on_record: Callable[[EngineKey, Sequence[int], float], None] | None = None
        """Told of each expiring record written through :meth:`add` (a routing decision's:
        engine, keys, ttl), once it is recorded: the replicated mode publishes them to
        the other replicas (the simulator likewise)."""
        self._ids_generation = 0
        """Changes whenever an engine's id is retired: the compiled table caches the
        candidates' ids by object identity until it does."""

    @property
    def evicted(self) -> Counter[str]:
        """Firm records evicted for room: ``engine_cap`` and ``index_cap``."""
        engine_cap, index_cap = self._table.evicted
        counts: Counter[str] = Counter()
        if engine_cap:
            counts["engine_cap"] = engine_cap
        if index_cap:
            counts["index_cap"] = index_cap
        return counts

    @property
    def expiring(self) -> int:
        """Expiring records held (provisional and approximate-mode holders)."""
        return self._table.expiring

    # ------------------------------------------------------------------ engine ids

    def _id(self, engine: EngineKey) -> int:
        idx = self._ids.get(engine)
        if idx is None:
            if self._free:
                idx = self._free.pop()
                self._names[idx] = engine
            else:
                idx = len(self._names)
                self._names.append(engine)
            self._ids[engine] = idx
        return idx

    # ------------------------------------------------------------------ lookups

    async def lookup(
        self, keys: Sequence[int], candidates: Sequence[EngineKey]
    ) -> Mapping[EngineKey, Match]:
        return self.lookup_now(keys, candidates)

    def lookup_now(
        self, keys: Sequence[int], candidates: Sequence[EngineKey]
    ) -> dict[EngineKey, Match]:
        """Synchronous lookup (the in-memory backend never waits)."""
        if not keys or not candidates:
            return {}
        table = self._table
        if table.next_deadline <= self._clock():
            table.sweep(self._clock())
        return table.lookup(keys, candidates, self._ids, self._names, Match, self._ids_generation)

    # ------------------------------------------------------------------ writes

    async def add(
        self,
        engine: EngineKey,
        keys: Sequence[int],
        tier: Tier = Tier.GPU,
        ttl: float | None = None,
    ) -> None:
        self.add_now(engine, keys, tier, ttl)
        if ttl is not None and self.on_record is not None:
            self.on_record(engine, keys, ttl)

    def add_now(
        self,
        engine: EngineKey,
        keys: Sequence[int],
        tier: Tier = Tier.GPU,
        ttl: float | None = None,
    ) -> None:
        """Synchronous :meth:`add`. Expiring records are always GPU-tier predictions."""
        idx = self._id(engine)
        if ttl is None:
            self._table.add(idx, tier, keys)
            return
        now = self._clock()
        self._table.sweep(now)
        self._table.add_expiring(idx, keys, now + ttl)

    async def remove(
        self, engine: EngineKey, keys: Sequence[int], tier: Tier | None = None
    ) -> None:
        self.remove_now(engine, keys, tier)

    def remove_now(self, engine: EngineKey, keys: Sequence[int], tier: Tier | None = None) -> None:
        """Synchronous :meth:`remove`."""
        idx = self._ids.get(engine)
        if idx is None:
            return
        self._table.remove(idx, EVERY_TIER if tier is None else tier, keys)

    async def clear(self, engine: EngineKey) -> None:
        self.clear_now(engine)

    def clear_now(self, engine: EngineKey) -> None:
        """Synchronous :meth:`clear`; the engine's id is freed for reuse."""
        idx = self._ids.pop(engine, None)
        if idx is None:
            return
        self._table.clear(idx)
        self._names[idx] = None
        self._free.append(idx)
        self._ids_generation += 1

    # ------------------------------------------------------------------ footprint

    def footprint(self, seen: set[int] | None = None) -> int:
        """Bytes the index holds: the compiled table's own count of its arrays, or the
        pure table's Python objects by ``sys.getsizeof`` (its dicts and the ints they
        hold, each object once; ``seen``: ids already counted, shared with other
        structures such as the event streams' maps; small ints are the interpreter's
        own). Expiring records' deadlines included. For reports, not the request path."""
        table = self._table
        return table.footprint(seen) if isinstance(table, BitmaskTable) else table.stats()[3]

    async def stats(self) -> IndexStats:
        return self.stats_now()

    async def held_blocks(self) -> Mapping[EngineKey, int]:
        return {engine: self._table.held_union(idx) for engine, idx in self._ids.items()}

    def held_keys(self, engine: EngineKey, tier: Tier = Tier.GPU) -> list[int]:
        """The keys ``engine`` holds firmly in ``tier``, oldest stored first."""
        idx = self._ids.get(engine)
        return [] if idx is None else self._table.held_keys(idx, tier)

    def stats_now(self) -> IndexStats:
        """Synchronous :meth:`stats`."""
        table = self._table
        table.sweep(self._clock())
        blocks, entries, _, size = table.stats()
        return IndexStats(
            blocks=blocks,
            entries=entries + table.expiring,
            engines=sum(1 for idx in self._ids.values() if any(table.held(idx, t) for t in Tier)),
            evicted=dict(self.evicted),
            bytes=size if self.compact else None,
        )
