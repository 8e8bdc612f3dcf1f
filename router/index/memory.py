"""The embedded in-memory index (the default backend).

Each block key maps to a bitmask of the engines that hold it, one dict per tier, so a
block held by many engines costs one entry and a lookup is one dict probe and an AND
per block, stopped at the first block no candidate holds. (A cumulative AND built from
``accumulate``/``takewhile``/``groupby`` measured slower than this loop.) Engines get
small integer ids; cleared engines' ids are reused.

Expiring holders (provisional and approximate-mode records) are set in the GPU mask
like firm ones and remembered with their deadline; every read first sweeps out what
has expired (a heap check when nothing has), so lookups never test deadlines per key.
Whether a GPU bit is firm is known from the engine's per-tier dicts of firmly held keys.
There is one mask dict per tier (GPU, CPU, disk); a block held in several tiers has a
bit in each, and a match counts it at the fastest.

Memory is bounded by ``max_entries`` (firm records in all) and ``max_entries_per_engine``
(firm records of one engine in one tier); 0 is no limit. Each engine's firmly held keys
per tier are an insertion-ordered dict, oldest stored first (a key stored again moves to
the end), so the least recently stored go first: past an engine's cap its oldest eighth
goes; past the index's cap the largest (engine, tier) loses its oldest eighth, until the
index is back to seven eighths of its cap. Evicting an eighth at once keeps eviction
amortized O(1) per stored key (a dict emptied from the front is compacted only when it
grows). ``evicted`` counts records evicted, by cause.
"""

from __future__ import annotations

import heapq
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from typing import Any

from router.index.base import IndexStats, KVIndex, Match, oldest, store_newest, trimmed_size
from router.types import EngineKey, Tier


def _bits(mask: int) -> Iterator[int]:
    """Indices of the set bits of ``mask``."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def footprint(tables: Iterable[dict[Any, Any]], seen: set[int] | None = None) -> int:
    """Bytes of ``tables`` and the objects they hold (one level of dicts inside
    included), each counted once across calls that share ``seen``."""
    seen = set() if seen is None else seen
    total = 0

    def count(obj: object) -> None:
        nonlocal total
        if (type(obj) is int and -5 <= obj <= 256) or id(obj) in seen:  # type: ignore[operator]
            return
        seen.add(id(obj))
        total += sys.getsizeof(obj)

    for table in tables:
        count(table)
        for key, value in table.items():
            count(key)
            count(value)
            if type(value) is dict:
                for inner_key, inner in value.items():
                    count(inner_key)
                    count(inner)
    return total


def _clear_bit(table: dict[int, int], key: int, bit: int) -> None:
    mask = table.get(key, 0)
    if mask & bit:
        mask &= ~bit
        if mask:
            table[key] = mask
        else:
            del table[key]


_NONE = repeat(None)


class MemoryIndex(KVIndex):
    """Bitmask index held in this process."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = 0,
        max_entries_per_engine: int = 0,
    ) -> None:
        """``max_entries``: at most this many firm records in all; ``max_entries_per_engine``:
        of one engine in one tier (0: no limit; the module docstring says what goes)."""
        if max_entries < 0 or max_entries_per_engine < 0:
            raise ValueError("max_entries and max_entries_per_engine must be >= 0")
        self._clock = clock
        self.max_entries = max_entries
        self.max_entries_per_engine = max_entries_per_engine
        self._capped = bool(max_entries or max_entries_per_engine)
        self._entries = 0
        """Firm records held (the sum of every engine's per-tier key dicts)."""
        self.evicted: Counter[str] = Counter()
        """Firm records evicted for room: ``engine_cap`` and ``index_cap``."""
        self._ids: dict[EngineKey, int] = {}
        self._bit_of: dict[EngineKey, int] = {}
        """Engine -> ``1 << id``, so a lookup's candidate mask needs no shifts."""
        self._names: list[EngineKey | None] = []
        self._free: list[int] = []
        self._tiers: tuple[dict[int, int], ...] = tuple({} for _ in Tier)
        self._held: list[tuple[dict[int, None], ...]] = []
        """Per engine id: keys it holds firmly, per tier (GPU, CPU, disk), oldest stored
        first."""
        self._exp: dict[int, dict[int, float]] = {}
        """key -> engine id -> deadline of an expiring GPU record."""
        self._exp_heap: list[tuple[float, int, int, Sequence[int]]] = []
        self._exp_count = 0
        self._seq = 0

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
                self._held.append(tuple({} for _ in Tier))
            self._ids[engine] = idx
            self._bit_of[engine] = 1 << idx
        return idx

    def _candidate_mask(self, candidates: Sequence[EngineKey]) -> int:
        bit_of = self._bit_of.get
        mask = 0
        for engine in candidates:
            bit = bit_of(engine)
            if bit:
                mask |= bit
        return mask

    # ------------------------------------------------------------------ lookups

    async def lookup(
        self, keys: Sequence[int], candidates: Sequence[EngineKey]
    ) -> Mapping[EngineKey, Match]:
        return self.lookup_now(keys, candidates)

    def lookup_now(
        self, keys: Sequence[int], candidates: Sequence[EngineKey]
    ) -> dict[EngineKey, Match]:
        """Synchronous lookup (the in-memory backend never waits)."""
        alive = self._candidate_mask(candidates)
        if not alive or not keys:
            return {}
        if self._exp_heap and self._exp_heap[0][0] <= self._clock():
            self._sweep(self._clock())
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
                    for idx in _bits(alive & ~held):
                        depth[idx] = pos
                alive = held
                if not alive:
                    break
        else:
            pos = len(keys)
        for idx in _bits(alive):
            depth[idx] = pos
        names = self._names
        if not off:
            return {names[idx]: Match(d) for idx, d in depth.items() if d}  # type: ignore[misc]
        result: dict[EngineKey, Match] = {}
        for idx, d in depth.items():
            if d:
                bit = 1 << idx
                only_off = only_disk = 0
                for k in keys[:d]:
                    if not gpu_get(k, 0) & bit:
                        only_off += 1
                        if not cpu_get(k, 0) & bit:
                            only_disk += 1
                result[names[idx]] = Match(d, only_off, only_disk)  # type: ignore[index]
        return result

    # ------------------------------------------------------------------ writes

    async def add(
        self,
        engine: EngineKey,
        keys: Sequence[int],
        tier: Tier = Tier.GPU,
        ttl: float | None = None,
    ) -> None:
        self.add_now(engine, keys, tier, ttl)

    def add_now(
        self,
        engine: EngineKey,
        keys: Sequence[int],
        tier: Tier = Tier.GPU,
        ttl: float | None = None,
    ) -> None:
        """Synchronous :meth:`add`. Expiring records are always GPU-tier predictions."""
        idx = self._id(engine)
        bit = 1 << idx
        if ttl is None:
            table = self._tiers[tier]
            get = table.get
            for key in keys:
                table[key] = get(key, 0) | bit
            held = self._held[idx][tier]
            before = len(held)
            store_newest(held, keys, _NONE, reorder=self._capped)
            self._entries += len(held) - before
            if self._capped:
                self._make_room(idx, tier)
            return
        held = self._held[idx][Tier.GPU]
        now = self._clock()
        if self._exp_heap:
            self._sweep(now)
        deadline = now + ttl
        gpu = self._tiers[Tier.GPU]
        gpu_get = gpu.get
        exp = self._exp
        fresh: list[int] = []
        for key in keys:
            if key in held:
                continue
            gpu[key] = gpu_get(key, 0) | bit
            pending = exp.get(key)
            if pending is None:
                exp[key] = {idx: deadline}
                self._exp_count += 1
            else:
                if idx not in pending:
                    self._exp_count += 1
                pending[idx] = deadline
            fresh.append(key)
        if fresh:
            self._seq += 1
            heapq.heappush(self._exp_heap, (deadline, self._seq, idx, fresh))

    async def remove(
        self, engine: EngineKey, keys: Sequence[int], tier: Tier | None = None
    ) -> None:
        self.remove_now(engine, keys, tier)

    def remove_now(self, engine: EngineKey, keys: Sequence[int], tier: Tier | None = None) -> None:
        """Synchronous :meth:`remove`."""
        idx = self._ids.get(engine)
        if idx is None:
            return
        bit = 1 << idx
        gpu = self._tiers[Tier.GPU]
        held_gpu = self._held[idx][Tier.GPU]
        exp = self._exp
        slower = [
            (self._tiers[t], self._held[idx][t])
            for t in Tier
            if t is not Tier.GPU and (tier is None or tier is t)
        ]
        gone = 0
        for key in keys:
            if tier is None or tier is Tier.GPU:
                _clear_bit(gpu, key, bit)
                if held_gpu.pop(key, 0) is None:
                    gone += 1
                if exp:
                    pending = exp.get(key)
                    if pending and pending.pop(idx, None) is not None:
                        self._exp_count -= 1
                        if not pending:
                            del exp[key]
            for table, held in slower:
                _clear_bit(table, key, bit)
                if held.pop(key, 0) is None:
                    gone += 1
        self._entries -= gone

    async def clear(self, engine: EngineKey) -> None:
        self.clear_now(engine)

    def clear_now(self, engine: EngineKey) -> None:
        """Synchronous :meth:`clear`; the engine's id is freed for reuse."""
        idx = self._ids.pop(engine, None)
        self._bit_of.pop(engine, None)
        if idx is None:
            return
        bit = 1 << idx
        for table, held in zip(self._tiers, self._held[idx], strict=True):
            for key in held:
                _clear_bit(table, key, bit)
            self._entries -= len(held)
        self._held[idx] = tuple({} for _ in Tier)
        exp = self._exp
        gpu = self._tiers[Tier.GPU]
        kept = []
        for entry in self._exp_heap:
            if entry[2] != idx:
                kept.append(entry)
                continue
            for key in entry[3]:
                pending = exp.get(key)
                if pending and pending.pop(idx, None) is not None:
                    self._exp_count -= 1
                    _clear_bit(gpu, key, bit)
                    if not pending:
                        del exp[key]
        heapq.heapify(kept)
        self._exp_heap = kept
        self._names[idx] = None
        self._free.append(idx)

    # ------------------------------------------------------------------ room

    def _make_room(self, idx: int, tier: Tier) -> None:
        """After a store by engine ``idx`` in ``tier``: evict what is over the caps."""
        cap = self.max_entries_per_engine
        held = self._held[idx][tier]
        if cap and len(held) > cap:
            self._evict(idx, tier, len(held) - trimmed_size(cap), "engine_cap")
        cap = self.max_entries
        if not cap or self._entries <= cap:
            return
        target = trimmed_size(cap)
        while self._entries > target:
            biggest, tier_of, most = idx, tier, -1
            for i, tiers in enumerate(self._held):
                for t, keys in zip(Tier, tiers, strict=True):
                    if len(keys) > most:
                        biggest, tier_of, most = i, t, len(keys)
            if most <= 0:
                return
            share = min(self._entries - target, max(most // 8, 1))
            self._evict(biggest, tier_of, share, "index_cap")

    def _evict(self, idx: int, tier: Tier, count: int, why: str) -> None:
        """Remove engine ``idx``'s ``count`` least recently stored keys of ``tier``."""
        victims = oldest(self._held[idx][tier], count)
        engine = self._names[idx]
        if engine is None or not victims:
            return
        self.remove_now(engine, victims, tier)
        self.evicted[why] += len(victims)

    # ------------------------------------------------------------------ footprint

    def footprint(self, seen: set[int] | None = None) -> int:
        """Bytes of the index's Python objects by ``sys.getsizeof``: its dicts and the
        ints they hold, each object once (``seen``: ids already counted, shared with
        other structures such as the event streams' maps). Small ints are the
        interpreter's own and cost nothing. Walks every entry: for reports, not the
        request path."""
        return footprint(
            [*self._tiers, *(t for tiers in self._held for t in tiers), self._exp], seen
        )

    # ------------------------------------------------------------------ housekeeping

    def _sweep(self, now: float) -> None:
        """Drop expiring records whose deadline has passed."""
        heap = self._exp_heap
        exp = self._exp
        gpu = self._tiers[Tier.GPU]
        while heap and heap[0][0] <= now:
            _, _, idx, keys = heapq.heappop(heap)
            held = self._held[idx][Tier.GPU]
            bit = 1 << idx
            for key in keys:
                pending = exp.get(key)
                if pending is None:
                    continue
                deadline = pending.get(idx)
                if deadline is not None and deadline <= now:
                    del pending[idx]
                    self._exp_count -= 1
                    if not pending:
                        del exp[key]
                    if key not in held:
                        _clear_bit(gpu, key, bit)

    async def stats(self) -> IndexStats:
        return self.stats_now()

    async def held_blocks(self) -> Mapping[EngineKey, int]:
        held: dict[EngineKey, int] = {}
        for engine, idx in self._ids.items():
            gpu, cpu, disk = self._held[idx]
            held[engine] = len(gpu.keys() | cpu.keys() | disk.keys())
        return held

    def stats_now(self) -> IndexStats:
        """Synchronous :meth:`stats`."""
        self._sweep(self._clock())
        gpu, cpu, disk = self._tiers
        blocks = len(gpu) if not (cpu or disk) else len(gpu.keys() | cpu.keys() | disk.keys())
        return IndexStats(
            blocks=blocks,
            entries=sum(sum(len(t) for t in held) for held in self._held) + self._exp_count,
            engines=sum(1 for held in self._held if any(held)),
            evicted=dict(self.evicted),
        )
