"""The KV-block index interface every backend implements.

An index records, per block key, the engines that hold the block and in which tier. A
holder is either *firm* (from the engine's own KV events; lives until removed) or
*expiring* (recorded from a routing decision: a provisional holder until the engine's
events confirm it, or an approximate-mode holder for engines that publish no events).
A firm record for the same (key, engine, tier) replaces an expiring one.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

# Defined below the index: the Redis client (router/redis/) raises it too.
from router.availability import IndexUnavailable as IndexUnavailable
from router.metric_catalogue import INDEX_BLOCKS, INDEX_BYTES, INDEX_ENTRIES, INDEX_EVICTIONS
from router.types import EngineKey, Tier

if TYPE_CHECKING:
    from router.metric_catalogue import StateFamily

K = TypeVar("K")
V = TypeVar("V")


class Match(msgspec.Struct, gc=False):
    """How much of a prompt's prefix one engine holds.

    ``blocks`` is the match depth: leading blocks held in any tier, counted from block 0
    and stopping at the engine's first miss. Each block counts at its best (fastest)
    tier: ``offloaded`` of them are held in no GPU tier (the CPU and disk tiers: cheaper
    than recomputing, dearer than a GPU hit), and ``disk`` of those ``offloaded`` are
    held in neither GPU nor CPU (disk, shared storage, remote pools).
    """

    blocks: int
    offloaded: int = 0
    disk: int = 0

    def weighted(self, offload_weight: float, disk_weight: float | None = None) -> float:
        """Depth with CPU-tier blocks counted at ``offload_weight`` and disk-tier blocks
        at ``disk_weight`` (``offload_weight`` too when None: the one-offload-tier
        weighting)."""
        if disk_weight is None:
            disk_weight = offload_weight
        cpu = self.offloaded - self.disk
        return self.blocks - cpu * (1.0 - offload_weight) - self.disk * (1.0 - disk_weight)


@dataclass(slots=True)
class IndexStats:
    """Sizes for metrics and benchmarks."""

    blocks: int
    """Distinct block keys with at least one holder."""
    entries: int
    """(block, engine, tier) records, firm and expiring."""
    engines: int
    """Engines with at least one firm record."""
    evicted: dict[str, int] = field(default_factory=dict)
    """Firm records evicted for room, by cause (``engine_cap``, ``index_cap``; a
    backend that does not bound itself: none)."""
    bytes: int | None = None
    """Bytes the index's own structures hold, where the backend counts them cheaply
    (the compiled in-memory table; None otherwise)."""

    def metric_families(self) -> Iterator[StateFamily]:
        """The sizes, and evictions by cause (every cause, evicted or not)."""
        yield INDEX_BLOCKS.value(self.blocks)
        yield INDEX_ENTRIES.value(self.entries)
        if self.bytes is not None:
            yield INDEX_BYTES.value(self.bytes)
        causes = ("engine_cap", "index_cap")
        yield INDEX_EVICTIONS.labelled(((c,), self.evicted.get(c, 0)) for c in causes)


def trimmed_size(cap: int) -> int:
    """What a bounded table over its cap is cut back to: seven eighths of the cap (at
    least one less), so eviction runs once per eighth of it stored, not per store."""
    return min(cap - cap // 8, cap - 1)


def store_newest(table: dict[K, V], keys: Sequence[K], values: Iterable[V], reorder: bool) -> None:
    """Store ``keys`` -> ``values`` in an insertion-ordered ``table`` (oldest first) as
    its newest entries; ``reorder``: keys already there move to the end too (what a
    bounded table needs to evict the least recently stored). A compiled
    ``router._native.BlockMap`` does the same in one call (``values`` a sequence)."""
    store = getattr(table, "store", None)
    if store is not None:
        store(keys, values, reorder)
        return
    if reorder and table:
        pop = table.pop
        for key in keys:
            pop(key, None)
    table.update(zip(keys, values, strict=False))  # values may be endless (repeat)


def oldest(table: dict[K, V], count: int) -> list[K]:
    """The ``count`` least recently stored keys of an insertion-ordered ``table``."""
    return list(islice(table, count))


def pop_oldest(table: dict[K, V], count: int) -> list[V]:
    """Remove the ``count`` least recently stored entries of an insertion-ordered
    ``table`` (a dict or a compiled ``BlockMap``); returns their values, oldest first."""
    pop = getattr(table, "pop_oldest", None)
    if pop is not None:
        return pop(count)  # type: ignore[no-any-return]
    return [table.pop(key) for key in oldest(table, count)]


def footprint(tables: Iterable[Any], seen: set[int] | None = None) -> int:
    """Bytes of ``tables`` and the objects they hold (one level of dicts inside
    included), each counted once across calls that share ``seen``. A table that is not a
    dict (a compiled ``BlockMap``) holds no objects: its ``sys.getsizeof`` is all of it."""
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
        if type(table) is not dict:
            continue
        for key, value in table.items():
            count(key)
            count(value)
            if type(value) is dict:
                for inner_key, inner in value.items():
                    count(inner_key)
                    count(inner)
    return total


class FallbackMatches(dict[EngineKey, Match]):
    """Matches a backend answered without the index itself, e.g. from a router's shadow
    of its own decisions; ``note`` (``shadow:over_budget``) says how and why, and the
    decision's reason carries it."""

    __slots__ = ("note",)

    def __init__(self, matches: Mapping[EngineKey, Match], note: str) -> None:
        super().__init__(matches)
        self.note = note


class KVIndex(ABC):
    """Records and looks up which engines hold which block keys."""

    @abstractmethod
    async def lookup(
        self, keys: Sequence[int], candidates: Sequence[EngineKey]
    ) -> Mapping[EngineKey, Match]:
        """Match depth of each candidate for ``keys`` (a prompt's chained block keys).

        The walk stops at the first block no candidate holds. Engines with depth 0 are
        left out of the result. Expired holders do not count.
        """

    @abstractmethod
    async def add(
        self,
        engine: EngineKey,
        keys: Sequence[int],
        tier: Tier = Tier.GPU,
        ttl: float | None = None,
    ) -> None:
        """Record ``engine`` as a holder of ``keys``: firm when ``ttl`` is None, else for
        ``ttl`` seconds. An expiring record never downgrades a firm one."""

    @abstractmethod
    async def remove(
        self, engine: EngineKey, keys: Sequence[int], tier: Tier | None = None
    ) -> None:
        """Drop ``engine``'s records of ``keys`` in ``tier`` (every tier when None)."""

    @abstractmethod
    async def clear(self, engine: EngineKey) -> None:
        """Drop everything ``engine`` holds, firm and expiring (AllBlocksCleared, a
        restart, a gap no replay covers, its removal). Expiring records go too: requests
        sent to an engine that restarted will never store their blocks there."""

    @abstractmethod
    async def stats(self) -> IndexStats:
        """Current sizes."""

    async def held_blocks(self) -> Mapping[EngineKey, int] | None:
        """Blocks each engine holds firmly, in any tier (the admin view); None when the
        backend cannot count them cheaply."""
        return None

    async def close(self) -> None:  # noqa: B027 - optional hook for backends with resources
        """Release resources held by the backend."""
