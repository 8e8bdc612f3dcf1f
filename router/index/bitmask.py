"""The in-memory index's pure-Python holder tables: the twin of the compiled
``router._native.BlockIndex`` (router/native/blocktable.c), used where that is not built
or ``KVROUTE_PURE_PYTHON=1`` is set; tests hold the two equal.

Each block key maps to a bitmask of the engines that hold it, one dict per tier, so a
block held by many engines costs one entry and a lookup is one dict probe and an AND
per block, stopped at the first block no candidate holds. (A cumulative AND built from
``accumulate``/``takewhile``/``groupby`` measured slower than this loop.) Expiring
records set the engine's GPU bit like firm ones; whether a GPU bit is firm is known from
the engine's per-tier dicts of firmly held keys, which are insertion-ordered, oldest
stored first (a key stored again moves to the end when the table is bounded), so the
least recently stored go first when a cap is passed: past an engine's cap its oldest
eighth goes; past the table's cap the largest (engine, tier) loses its oldest eighth,
until the table is back to seven eighths of its cap. Evicting an eighth at once keeps
eviction amortized O(1) per stored key (a dict emptied from the front is compacted only
when it grows).

Expiring records (a routing decision's provisional holders) set the engine's GPU bit
too, with their deadlines in a dict per key and a heap to sweep by.

Engines are named by the small integer ids :class:`router.index.memory.MemoryIndex`
gives them; tiers by ``Tier``'s value, or -1 for every tier.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from typing import Any

from router.index.base import Match, footprint, oldest, store_newest, trimmed_size
from router.types import Tier

_NONE = repeat(None)
EVERY_TIER = -1


def bits(mask: int) -> Iterator[int]:
    """Indices of the set bits of ``mask``."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _clear_bit(table: dict[int, int], key: int, bit: int) -> None:
    mask = table.get(key, 0)
    if mask & bit:
        mask &= ~bit
        if mask:
            table[key] = mask
        else:
            del table[key]


class BitmaskTable:
    """Who holds which block keys, in dicts of engine bitmasks."""

    def __init__(self, max_entries: int = 0, max_entries_per_engine: int = 0) -> None:
        if max_entries < 0 or max_entries_per_engine < 0:
            raise ValueError("max_entries and max_entries_per_engine must be >= 0")
        self.max_entries = max_entries
        self.max_entries_per_engine = max_entries_per_engine
        self._capped = bool(max_entries or max_entries_per_engine)
        self.entries = 0
        """Firm records held (the sum of every engine's per-tier key dicts)."""
        self._evicted = [0, 0]
        self._tiers: tuple[dict[int, int], ...] = tuple({} for _ in Tier)
        self._held: list[tuple[dict[int, None], ...]] = []
        """Per engine id: keys it holds firmly, per tier, oldest stored first."""
        self._exp: dict[int, dict[int, float]] = {}
        """key -> engine id -> deadline of an expiring GPU record."""
        self._exp_heap: list[tuple[float, int, int, list[int]]] = []
        self.expiring = 0
        """Expiring records held."""
        self._seq = 0

    @property
    def evicted(self) -> tuple[int, int]:
        """Firm records evicted for room: (past an engine's cap, past the table's)."""
        return (self._evicted[0], self._evicted[1])

    @property
    def next_deadline(self) -> float:
        """The earliest deadline to sweep at (inf: none)."""
        return self._exp_heap[0][0] if self._exp_heap else float("inf")

    def _engine(self, idx: int) -> tuple[dict[int, None], ...]:
        while len(self._held) <= idx:
            self._held.append(tuple({} for _ in Tier))
        return self._held[idx]

    # ------------------------------------------------------------------ writes

    def add(self, idx: int, tier: int, keys: Sequence[int]) -> int:
        """Record engine ``idx`` as a firm holder of ``keys`` in ``tier``; returns the
        records new to the table."""
        bit = 1 << idx
        table = self._tiers[tier]
        get = table.get
        for key in keys:
            table[key] = get(key, 0) | bit
        held = self._engine(idx)[tier]
        before = len(held)
        store_newest(held, keys, _NONE, reorder=self._capped)
        fresh = len(held) - before
        self.entries += fresh
        if self._capped:
            self._make_room(idx, tier)
        return fresh

    def add_expiring(self, idx: int, keys: Sequence[int], deadline: float) -> None:
        """Mark engine ``idx`` as a GPU holder of ``keys`` until ``deadline``, those it
        holds there firmly aside (a later add moves a record's deadline)."""
        held = self._engine(idx)[Tier.GPU]
        bit = 1 << idx
        gpu = self._tiers[Tier.GPU]
        gpu_get = gpu.get
        exp = self._exp
        marked = []
        for key in keys:
            if key in held:
                continue
            gpu[key] = gpu_get(key, 0) | bit
            marked.append(key)
            pending = exp.get(key)
            if pending is None:
                exp[key] = {idx: deadline}
                self.expiring += 1
            else:
                if idx not in pending:
                    self.expiring += 1
                pending[idx] = deadline
        if marked:
            self._seq += 1
            heapq.heappush(self._exp_heap, (deadline, self._seq, idx, marked))

    def sweep(self, now: float) -> None:
        """Drop the expiring records whose deadline is at or before ``now``."""
        heap = self._exp_heap
        exp = self._exp
        gpu = self._tiers[Tier.GPU]
        while heap and heap[0][0] <= now:
            _, _, idx, keys = heapq.heappop(heap)
            held = self._engine(idx)[Tier.GPU]
            bit = 1 << idx
            for key in keys:
                pending = exp.get(key)
                if pending is None:
                    continue
                deadline = pending.get(idx)
                if deadline is not None and deadline <= now:
                    del pending[idx]
                    self.expiring -= 1
                    if not pending:
                        del exp[key]
                    if key not in held:
                        _clear_bit(gpu, key, bit)

    def _drop_pending(self, idx: int, keys: Iterable[int]) -> None:
        """Forget engine ``idx``'s expiring deadlines of ``keys``."""
        exp = self._exp
        for key in keys:
            pending = exp.get(key)
            if pending and pending.pop(idx, None) is not None:
                self.expiring -= 1
                if not pending:
                    del exp[key]

    def remove(self, idx: int, tier: int, keys: Sequence[int]) -> int:
        """Drop engine ``idx``'s records of ``keys`` in ``tier`` (``EVERY_TIER``: all);
        the GPU tier's removal takes expiring records too. Returns firm records gone."""
        held_by = self._engine(idx)
        bit = 1 << idx
        gone = 0
        for t in Tier:
            if tier != EVERY_TIER and tier != t:
                continue
            table, held = self._tiers[t], held_by[t]
            for key in keys:
                _clear_bit(table, key, bit)
                if held.pop(key, 0) is None:
                    gone += 1
            if t is Tier.GPU and self._exp:
                self._drop_pending(idx, keys)
        self.entries -= gone
        return gone

    def clear(self, idx: int) -> int:
        """Drop every record of engine ``idx``, firm and expiring; returns how many firm."""
        bit = 1 << idx
        gone = 0
        for table, held in zip(self._tiers, self._engine(idx), strict=True):
            for key in held:
                _clear_bit(table, key, bit)
            gone += len(held)
        self.entries -= gone
        self._held[idx] = tuple({} for _ in Tier)
        kept = []
        gpu = self._tiers[Tier.GPU]
        for entry in self._exp_heap:
            if entry[2] != idx:
                kept.append(entry)
                continue
            self._drop_pending(idx, entry[3])
            for key in entry[3]:
                _clear_bit(gpu, key, bit)
        heapq.heapify(kept)
        self._exp_heap = kept
        return gone

    # ------------------------------------------------------------------ reads

    def held(self, idx: int, tier: int) -> int:
        return len(self._held[idx][tier]) if idx < len(self._held) else 0

    def held_keys(self, idx: int, tier: int) -> list[int]:
        """The keys engine ``idx`` holds firmly in ``tier``, oldest stored first."""
        return list(self._held[idx][tier]) if idx < len(self._held) else []

    def held_union(self, idx: int) -> int:
        if idx >= len(self._held):
            return 0
        gpu, cpu, disk = self._held[idx]
        return len(gpu.keys() | cpu.keys() | disk.keys())

    def lookup(
        self,
        keys: Sequence[int],
        candidates: Sequence[Any],
        ids: Mapping[Any, int],
        names: Sequence[Any],
        match: type[Match],
        generation: int | None = None,
    ) -> dict[Any, Match]:
        """Match depth of each candidate (``ids``: candidate -> engine id; ``names``:
        engine id -> the result's key). ``generation`` is for the compiled table's id
        cache; this table reads ``ids`` every time."""
        get_id = ids.get
        alive = 0
        for engine in candidates:
            idx = get_id(engine)
            if idx is not None:
                alive |= 1 << idx
        if not alive or not keys:
            return {}
        gpu, cpu, disk = self._tiers
        off = cpu or disk
        gpu_get, cpu_get, disk_get = gpu.get, cpu.get, disk.get
        depth: dict[int, int] = {}
        pos = 0
        for pos, key in enumerate(keys):
            held = (
                gpu_get(key, 0) | cpu_get(key, 0) | disk_get(key, 0) if off else gpu_get(key, 0)
            ) & alive
            if held != alive:
                if pos:  # engines without the first block match nothing: no entry
                    for idx in bits(alive & ~held):
                        depth[idx] = pos
                alive = held
                if not alive:
                    break
        else:
            pos = len(keys)
        for idx in bits(alive):
            depth[idx] = pos
        if not off:
            return {names[idx]: match(d) for idx, d in depth.items() if d}
        result: dict[Any, Match] = {}
        for idx, d in depth.items():
            if d:
                bit = 1 << idx
                only_off = only_disk = 0
                for k in keys[:d]:
                    if not gpu_get(k, 0) & bit:
                        only_off += 1
                        if not cpu_get(k, 0) & bit:
                            only_disk += 1
                result[names[idx]] = match(d, only_off, only_disk)
        return result

    def stats(self) -> tuple[int, int, int, int]:
        """(distinct keys, firm records, 0, 0): holder sets and bytes are the compiled
        table's; :meth:`footprint` measures this one's bytes."""
        gpu, cpu, disk = self._tiers
        blocks = len(gpu) if not (cpu or disk) else len(gpu.keys() | cpu.keys() | disk.keys())
        return (blocks, self.entries, 0, 0)

    def footprint(self, seen: set[int] | None = None) -> int:
        """Bytes of the table's dicts and the ints they hold (``seen``: object ids
        already counted elsewhere). Walks every entry: for reports only."""
        return footprint(
            [*self._tiers, *(t for tiers in self._held for t in tiers), self._exp], seen
        )

    # ------------------------------------------------------------------ room

    def _make_room(self, idx: int, tier: int) -> None:
        """After a store by engine ``idx`` in ``tier``: evict what is over the caps."""
        cap = self.max_entries_per_engine
        held = self._held[idx][tier]
        if cap and len(held) > cap:
            self._evict(idx, tier, len(held) - trimmed_size(cap), 0)
        cap = self.max_entries
        if not cap or self.entries <= cap:
            return
        target = trimmed_size(cap)
        while self.entries > target:
            biggest, tier_of, most = idx, tier, -1
            for i, tiers in enumerate(self._held):
                for t, keys in zip(Tier, tiers, strict=True):
                    if len(keys) > most:
                        biggest, tier_of, most = i, t, len(keys)
            if most <= 0:
                return
            share = min(self.entries - target, max(most // 8, 1))
            self._evict(biggest, tier_of, share, 1)

    def _evict(self, idx: int, tier: int, count: int, cause: int) -> None:
        """Remove engine ``idx``'s ``count`` least recently stored keys of ``tier``."""
        victims = oldest(self._held[idx][tier], count)
        self.remove(idx, tier, victims)
        self._evicted[cause] += len(victims)
