"""The contract of a shared (remote) index: one several routers and indexers use at once.

A :class:`RemoteIndex` is a :class:`~router.index.base.KVIndex` in another process
(Redis is the one shipped: ``router/index/redis.py``), so it adds what the code around
it needs from such a thing:

* **Availability.** Any call may raise :class:`~router.index.base.IndexUnavailable`;
  ``available`` says whether calls are tried at all, and ``listeners`` hear of every
  transition, on the way back with whether the backend may have lost its data.
  :class:`~router.index.shadow.ShadowedIndex` answers from a router's own decisions
  meanwhile and reconciles after.
* **Batched writes.** :meth:`RemoteIndex.write` applies :class:`WriteBatch` es (one
  engine's ops each, atomically) in one round trip: the shadow's decision records and
  the event writer's KV-event batches (``router/events/writer.py``).
* **Fencing** (:class:`FencedIndex`, the standalone indexer). One writer per engine
  stream holds a lease; a fenced batch applies only under the lease and past the last
  applied sequence number, and the position is kept for the next writer.
"""

from __future__ import annotations

from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Literal, NamedTuple, TypeVar

# Defined below the index: the Redis client (router/redis/) reports them too.
from router.availability import AvailabilityListener as AvailabilityListener
from router.availability import RemoteCounters as RemoteCounters
from router.index.base import KVIndex
from router.types import EngineKey, Tier


class AddOp(NamedTuple):
    """Firm holder of ``keys`` in ``tier``; ``hashes`` are the engine's own ids for them
    (kept so a new indexer can apply removals after taking over)."""

    keys: Sequence[int]
    tier: Tier = Tier.GPU
    hashes: Sequence[int] | None = None


class ExpireOp(NamedTuple):
    """Expiring (provisional or approximate) GPU holder of ``keys`` for ``ttl`` seconds."""

    keys: Sequence[int]
    ttl: float


class RemoveOp(NamedTuple):
    """Drop records of ``keys`` in ``tier`` (every tier when None)."""

    keys: Sequence[int]
    tier: Tier | None = None


class ClearOp(NamedTuple):
    """Drop everything the engine holds."""


WriteOp = AddOp | ExpireOp | RemoveOp | ClearOp


@dataclass(frozen=True, slots=True)
class Fence:
    """The lease token and stream position a fenced write carries: applied only while
    ``token`` holds the engine's lease and ``seq`` is newer than the last applied one,
    which then becomes ``seq`` (at ``ts``). ``seq`` None forgets the position instead."""

    token: str
    seq: int | None
    ts: float = 0.0


@dataclass(slots=True)
class WriteBatch:
    """Writes for one engine, applied atomically."""

    engine: EngineKey
    ops: list[WriteOp]
    fence: Fence | None = None


_Queued = TypeVar("_Queued")


def take_for_write(
    queue: deque[_Queued], max_items: int, max_keys: int, keys_of: Callable[[_Queued], int]
) -> list[_Queued]:
    """The queue's front for one write: at most ``max_items`` items, and no more once
    those taken hold ``max_keys`` keys (the first is always taken, however many)."""
    taken: list[_Queued] = []
    keys = 0
    while queue and len(taken) < max_items and (not taken or keys < max_keys):
        item = queue.popleft()
        taken.append(item)
        keys += keys_of(item)
    return taken


class WriteResult(IntEnum):
    """What the backend did with a batch."""

    APPLIED = 1
    STALE_TOKEN = -1
    """Another writer holds the engine's lease (or it expired): nothing was written."""
    OLD_SEQ = -2
    """The batch's sequence number was already applied: nothing was written."""


@dataclass(slots=True)
class StreamPosition:
    """What a new writer needs to continue an engine's stream where the last one left."""

    seq: int | None
    """Last applied sequence number, None when the stream starts afresh."""
    ts: float | None
    """Timestamp of that batch (tells the same engine life from a restarted one)."""
    hashes: tuple[dict[int, int], ...]
    """Engine hash -> block key of firmly held blocks, per tier (GPU, CPU, disk)."""


class RemoteIndex(KVIndex):
    """A :class:`KVIndex` shared between processes, which may be away."""

    listeners: list[AvailabilityListener]
    """Told of every availability transition (the backend's constructor makes it)."""
    counters: RemoteCounters

    @property
    @abstractmethod
    def available(self) -> bool:
        """False from a failed call until the backend answers again (calls then fail at
        once with :class:`~router.index.base.IndexUnavailable`)."""

    @abstractmethod
    async def write(
        self, batches: Sequence[WriteBatch], timeout: float | None = None
    ) -> list[WriteResult]:
        """Apply ``batches`` in order, each atomically, in one round trip. Raises
        ``IndexUnavailable`` on failure or past ``timeout`` (some batches may have been
        applied then). A backend that is not a :class:`FencedIndex` refuses fences."""

    def describe(self) -> str:
        """Where the index lives, for log lines (never with credentials)."""
        return type(self).__name__


LeaseMode = Literal["acquire", "renew", "release"]


class FencedIndex(RemoteIndex):
    """A :class:`RemoteIndex` with per-engine writer leases and stream positions."""

    @abstractmethod
    async def lease(
        self,
        engine: EngineKey,
        token: str,
        ttl_ms: int,
        mode: LeaseMode,
        timeout: float | None = None,
    ) -> bool:
        """Acquire (or extend, if ``token`` holds it), ``renew`` or ``release`` the engine
        stream's writer lease; True when ``token`` holds it after (or released it)."""

    @abstractmethod
    async def stream_position(
        self, engine: EngineKey, timeout: float | None = None
    ) -> StreamPosition:
        """The engine stream's last applied batch and its engine-hash -> key maps."""
