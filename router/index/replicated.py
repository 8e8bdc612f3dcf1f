"""Replicated mode: an in-memory index per router replica, decisions shared through Redis.

With ``index.backend: replicated`` every replica keeps the whole KV-block index in its
own memory (a :class:`~router.index.memory.MemoryIndex`), fed by the KV events of every
engine it follows, so a lookup never leaves the process. What replicas must see of each
other travels through Redis off the request path:

* **Decisions.** :class:`ReplicatedIndex` records a decision's provisional holder
  locally at once, as the memory index does, and hands it to :class:`DecisionSync`,
  which appends them to one stream (``{ns}:v3:decisions``), at most one entry per
  ``sync_interval_s``: a decision after a quiet interval goes out at once, and under
  load the decisions of one interval share an entry. Every replica reads the stream with a
  blocking ``XREAD`` and records its peers' decisions in its own index with what is left
  of their life. Entries older than ``window_s`` are trimmed as new ones are added.
* **Load.** In-flight work per engine is exchanged as with the shared index
  (:class:`~router.fleet.shared_load.SharedLoad`), and its changes in between ride
  the stream's entries (an ``l`` field, ``index.redis.load_push``).
* **Warm start.** A replica that starts reads the stream from its oldest entry (the
  decisions still live), and one replica, elected by a lease, writes a snapshot of each
  engine stream's state (the engine-hash maps of what it holds, the last batch's sequence
  number and digest) every ``snapshot_interval_s``
  (:class:`~router.events.snapshots.SnapshotWriter`). A starting replica loads the
  snapshots (:func:`~router.events.snapshots.load_snapshots`), puts their blocks in its index and
  follows each engine from the snapshot's batch, replaying the rest from the engine's own
  replay buffer, so it routes on the engines' caches before any new event arrives. A
  replica back from a partition reads the stream on from where it stopped.

Redis unavailable degrades, never fails: lookups are local anyway; decisions queue (at
most ``max_pending``, oldest dropped first) and those still live are published when Redis
answers; peers' decisions made meanwhile are read then (what the stream still holds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sys
import time
from array import array
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from router.index.base import IndexUnavailable
from router.index.memory import MemoryIndex
from router.index.replicated_config import ReplicatedIndexConfig
from router.metric_catalogue import (
    REPLICA_SNAPSHOTS_WRITTEN,
    REPLICA_SYNC_APPLIED,
    REPLICA_SYNC_DELAY_SECONDS,
    REPLICA_SYNC_DROPPED,
    REPLICA_SYNC_ENTRIES,
    REPLICA_SYNC_ERRORS,
    REPLICA_SYNC_EXPIRED,
    REPLICA_SYNC_PENDING,
    REPLICA_SYNC_PUBLISHED,
    SESSION_PINS_LEARNT,
    SESSION_PINS_PUBLISHED,
)
from router.redis.client import RedisClient
from router.redis.decision_stream import DecisionStream
from router.redis.schema import pack_keys
from router.sessions import MAX_KEY_CHARS, SessionMap
from router.types import EngineKey, Tier

if TYPE_CHECKING:
    from router.events.snapshots import SnapshotWriter
    from router.fleet.shared_load import SharedLoad
    from router.metric_catalogue import StateFamily

log = logging.getLogger("kvroute.index.replicated")

_NATIVE_LE = sys.byteorder == "little"

_Decision = tuple[str, int, int, float, bytes]
"""(endpoint, rank, ttl ms, made at (wall clock, seconds), packed block keys)."""
_Pin = tuple[str, str, int, int, float]
"""(session key, endpoint, rank, ttl ms, made at): the ``latency`` policy's session
affinity (:class:`~router.sessions.SessionMap`), in an entry's ``s`` field."""
_Entry = (
    tuple[str, bytes, bytes]
    | tuple[str, bytes, bytes, bytes]
    | tuple[str, bytes, bytes, bytes, bytes]
)
"""A stream entry as read: (id, replica, decisions[, session pins[, load changes]])."""
_encode = msgspec.msgpack.Encoder().encode
_decode_decisions = msgspec.msgpack.Decoder(list[_Decision]).decode
_decode_pins = msgspec.msgpack.Decoder(list[_Pin]).decode

MAX_TTL_S = 86_400.0
"""A peer decision claiming a longer life than this is malformed (records live seconds
to minutes: ``policy.provisional_ttl_s``, ``policy.approximate_ttl_s``)."""
RETRY_S = 0.5
"""Pause after a failed publish or read before trying again (while Redis is reachable)."""
BLOCK_MS = 1000
"""How long one blocking read of the decision stream waits for an entry."""
READ_COUNT = 1024
"""Stream entries one read returns at most."""


def unpack_keys(raw: bytes) -> array[int]:
    """The inverse of :func:`~router.redis.schema.pack_keys`."""
    if len(raw) % 8:
        raise ValueError(f"packed keys of {len(raw)} bytes (not a multiple of 8)")
    keys = array("Q")
    keys.frombytes(raw)
    if not _NATIVE_LE:
        keys.byteswap()
    return keys


def encode_decisions(decisions: Iterable[_Decision]) -> bytes:
    """A stream entry's payload."""
    return _encode(list(decisions))


def decode_decisions(payload: bytes) -> list[_Decision]:
    """The inverse of :func:`encode_decisions` (``ValueError`` on a malformed payload)."""
    try:
        return _decode_decisions(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed decision entry: {exc}") from exc


@dataclass(slots=True)
class SyncCounters:
    """What decision sharing did, for metrics (never reset)."""

    published: int = 0
    """Own decisions appended to the stream."""
    entries: int = 0
    """Stream entries appended (each holds up to ``max_batch`` decisions)."""
    applied: int = 0
    """Peers' decisions recorded in this replica's index."""
    expired: int = 0
    """Peers' decisions read after their records' life ended (not recorded)."""
    dropped: Counter[str] = field(default_factory=Counter)
    """Own decisions never published, by reason: ``queue_full`` (Redis was away too long),
    ``expired`` (their records' life ended before Redis answered)."""
    malformed: int = 0
    """Stream entries that could not be decoded (skipped)."""
    foreign: int = 0
    """Peers' decisions for engines this replica does not serve (not recorded)."""
    read_errors: int = 0
    publish_errors: int = 0
    sessions_published: int = 0
    """Own session pins appended to the stream (the ``latency`` policy's affinity)."""
    sessions_applied: int = 0
    """Peers' session pins learnt."""
    delay_s: float = 0.0
    """How long the last applied peer decision took from its decision to this index (wall
    clocks of two hosts: as good as their synchronization)."""

    def errors_family(self) -> StateFamily:
        """Failed stream calls by operation, and entries that could not be decoded."""
        return REPLICA_SYNC_ERRORS.labelled(
            [
                (("publish",), self.publish_errors),
                (("read",), self.read_errors),
                (("malformed",), self.malformed),
            ]
        )


class DecisionSync:
    """Publishes this replica's decisions to the stream and applies its peers'."""

    def __init__(
        self,
        index: MemoryIndex | None,
        redis: RedisClient,
        config: ReplicatedIndexConfig,
        replica: str,
        *,
        known: Callable[[EngineKey], bool] | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.index = index
        self.redis = redis
        self.stream = DecisionStream(redis)
        """The decision stream in Redis, appended to and read over ``redis``."""
        self.config = config
        self.replica = replica
        self.known = known
        """Whether an engine is in this replica's fleet (peers' decisions for engines it
        does not serve are ignored); None: every engine."""
        self.wall = wall
        self._me = replica.encode()
        """This replica's id as the stream stores it (entries are compared as bytes)."""
        self.counters = SyncCounters()
        self.sessions: SessionMap | None = None
        """Where peers' session pins go (the ``latency`` policy's map); None: ignored."""
        self.clock: Callable[[], float] = time.monotonic
        """The clock of :attr:`sessions` (pins' expiry)."""
        self.load: SharedLoad | None = None
        """The replicas' load sharing whose changes ride this stream (its ``l`` field,
        ``index.redis.load_push``) and which applies the peers'; None: neither."""
        self._pending: deque[tuple[float, _Decision]] = deque()
        self._pins: deque[tuple[float, _Pin]] = deque()
        self._wake = asyncio.Event()
        self._up = asyncio.Event()
        self._up.set()
        self._last_id = "0-0"
        """The last stream entry read: reading starts from the oldest entry kept."""
        self._min_id: str | None = None
        self._epoch = 0
        """Changes when Redis comes back without its data: reads and appends begun before
        must not move the position or the trim point of the new stream."""
        self._tasks: list[asyncio.Task[None]] = []
        self._halted = False
        """Stopped (or halted): a start still catching up starts no tasks."""
        redis.listeners.append(self._on_availability)

    # ------------------------------------------------------------------ lifecycle

    async def start(self, catch_up_timeout: float = 2.0) -> None:
        """Read what the stream holds (the decisions still live), then follow it and
        publish in the background. A Redis that does not answer in time only delays the
        catch-up: the background reader does it."""
        try:
            await asyncio.wait_for(self.catch_up(), catch_up_timeout)
        except (IndexUnavailable, asyncio.TimeoutError):
            pass  # the background reader goes on from where it got
        except Exception:  # a bug must not keep the router from starting
            log.exception("reading peers' decisions failed")
        if not self._tasks and not self._halted:
            self._tasks = [
                asyncio.ensure_future(self._publish_forever()),
                asyncio.ensure_future(self._read_forever()),
            ]

    async def stop(self, flush_timeout: float = 1.0) -> None:
        """Publish what is queued (bounded), then stop."""
        self._halted = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        with contextlib.suppress(IndexUnavailable, asyncio.TimeoutError):
            await asyncio.wait_for(self.flush(), flush_timeout)
        with contextlib.suppress(ValueError):
            self.redis.listeners.remove(self._on_availability)

    def halt(self) -> None:
        """Stop at once, publishing nothing more (what is queued is dropped)."""
        self._halted = True
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        with contextlib.suppress(ValueError):
            self.redis.listeners.remove(self._on_availability)

    @property
    def pending(self) -> int:
        """Own decisions waiting to be published."""
        return len(self._pending)

    def session_families(self, errors: bool = True) -> Iterator[StateFamily]:
        """Session pins shared and learnt, and with ``errors`` the failed calls (unless
        the replicated index reports them with its own families)."""
        yield SESSION_PINS_PUBLISHED.value(self.counters.sessions_published)
        yield SESSION_PINS_LEARNT.value(self.counters.sessions_applied)
        if errors:
            yield self.counters.errors_family()

    def _on_availability(self, available: bool, data_lost: bool) -> None:
        if available:
            if data_lost:
                # A new stream, maybe on a host whose clock is behind: ids restart
                # wherever its clock says, so read it from its start and trim nothing by
                # the old stream's ids.
                self._epoch += 1
                self._last_id = "0-0"
                self._min_id = None
            self._up.set()
            self._wake.set()  # publish what queued up while it was away
        else:
            self._up.clear()

    # ------------------------------------------------------------------ publishing

    def publish(self, engine: EngineKey, keys: Sequence[int], ttl: float) -> None:
        """Queue one decision (never waits)."""
        if not keys:
            return
        pending = self._pending
        if len(pending) >= self.config.max_pending:
            pending.popleft()
            self.counters.dropped["queue_full"] += 1
        now = self.wall()
        pending.append(
            (now + ttl, (engine.endpoint, engine.rank, int(ttl * 1000), now, pack_keys(keys)))
        )
        self._wake.set()

    def wake(self) -> None:
        """Something new to publish (own load changed): the next append carries it."""
        self._wake.set()

    def publish_session(self, session: str, engine: EngineKey, ttl: float) -> None:
        """Queue one session pin (never waits): peers send the session's next request to
        ``engine`` as this replica would (``SessionMap.on_note``)."""
        pins = self._pins
        if len(pins) >= self.config.max_pending:
            pins.popleft()
            self.counters.dropped["queue_full"] += 1
        now = self.wall()
        pins.append((now + ttl, (session, engine.endpoint, engine.rank, int(ttl * 1000), now)))
        self._wake.set()

    async def _publish_forever(self) -> None:
        interval = self.config.sync_interval_s
        loop = asyncio.get_running_loop()
        last = -math.inf
        while True:
            await self._wake.wait()
            # At most one append per interval: after a quiet interval a decision goes
            # out at once; under load the decisions of one interval share an entry, so
            # Redis sees at most 1/interval appends per replica whatever the rate.
            wait = last + interval - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not self._up.is_set():
                await self._up.wait()  # nothing to gain from failing fast in a loop
            last = loop.time()
            self._wake.clear()
            try:
                await self.flush()
            except IndexUnavailable as exc:
                self.counters.publish_errors += 1
                log.debug("publishing decisions failed: %s", exc)
                if self.redis.available:
                    await asyncio.sleep(RETRY_S)  # Redis answered with an error
                    self._wake.set()
            except Exception:  # a bug must not end sharing
                log.exception("publishing decisions failed")
                await asyncio.sleep(RETRY_S)
                self._wake.set()

    async def flush(self) -> None:
        """Publish the decisions queued now that are still live, ``max_batch`` to a
        stream entry (those queued meanwhile wait for the next call), with the own load
        changes (:attr:`load`) in the first. Raises :class:`IndexUnavailable` (the batch
        in hand is queued again)."""
        pending, pins = self._pending, self._pins
        epoch = self._epoch
        left, pins_left = len(pending), len(pins)
        load = self.load
        changes = load is not None and load.has_changes
        while (pending and left > 0) or (pins and pins_left > 0) or changes:
            now = self.wall()
            batch: list[tuple[float, _Decision]] = []
            while pending and left > 0 and len(batch) < self.config.max_batch:
                left -= 1
                item = pending.popleft()
                if item[0] <= now:
                    self.counters.dropped["expired"] += 1
                    continue
                batch.append(item)
            pinned: list[tuple[float, _Pin]] = []
            while pins and pins_left > 0 and len(pinned) < self.config.max_batch:
                pins_left -= 1
                pin = pins.popleft()
                if pin[0] > now:
                    pinned.append(pin)
            taken = load.take_changes() if changes and load is not None else None
            changes = False
            if not batch and not pinned and taken is None:
                continue  # everything left in the round had expired
            try:
                entry = await self.stream.publish(
                    self.replica,
                    encode_decisions(d for _, d in batch),
                    self._min_id,
                    timeout=max(self.redis.budget, 0.25),
                    sessions=_encode([p for _, p in pinned]) if pinned else None,
                    load=taken[0] if taken is not None else None,
                )
            except BaseException:  # unavailable, or cancelled mid-append by stop()
                pending.extendleft(reversed(batch))
                pins.extendleft(reversed(pinned))
                if taken is not None and load is not None:
                    load.restore(taken[1])
                for queue in (pending, pins):
                    while len(queue) > self.config.max_pending:
                        queue.popleft()
                        self.counters.dropped["queue_full"] += 1
                raise
            self.counters.entries += 1
            self.counters.published += len(batch)
            self.counters.sessions_published += len(pinned)
            if taken is not None and load is not None:
                load.sent(taken[1])
            if epoch == self._epoch:  # else the id is the lost stream's
                ms = int(entry.partition("-")[0])
                self._min_id = f"{max(ms - int(self.config.window_s * 1000), 0)}-0"

    # ------------------------------------------------------------------ reading

    async def catch_up(self) -> int:
        """Read and apply every entry after the last one read; returns how many."""
        total = 0
        while True:
            epoch = self._epoch
            entries = await self.stream.read(self._last_id, READ_COUNT, None)
            await self._apply_yielding(entries, epoch)
            total += len(entries)
            if len(entries) < READ_COUNT:
                return total

    async def _apply_yielding(self, entries: Sequence[_Entry], epoch: int) -> None:
        """:meth:`apply`, an entry at a time, letting requests run in between (a replica
        back from a partition may have thousands of peers' decisions to record); stops
        if Redis came back without its data meanwhile (``epoch`` is the read's)."""
        for n, entry in enumerate(entries):
            if epoch != self._epoch:
                return  # entries of the lost stream: reading starts over
            self.apply((entry,))
            if n + 1 < len(entries):
                await asyncio.sleep(0)

    async def _read_forever(self) -> None:
        while True:
            if not self._up.is_set():
                await self._up.wait()
            epoch = self._epoch
            try:
                entries = await self.stream.read(self._last_id, READ_COUNT, BLOCK_MS)
            except IndexUnavailable as exc:
                self.counters.read_errors += 1
                log.debug("reading peers' decisions failed: %s", exc)
                await asyncio.sleep(RETRY_S)
                continue
            except Exception:  # a bug must not end sharing
                log.exception("reading peers' decisions failed")
                await asyncio.sleep(RETRY_S)
                continue
            try:
                await self._apply_yielding(entries, epoch)
            except Exception:  # a bug must not end sharing; the entries are passed
                log.exception("recording peers' decisions failed")

    def apply(self, entries: Sequence[_Entry]) -> None:
        """Record peers' decisions (and session pins, and load changes) from stream
        entries (id, replica, payload[, session pins[, load changes]])."""
        if not entries:
            return
        self._last_id = entries[-1][0]
        now = self.wall()
        known = self.known
        counters = self.counters
        for _, replica, payload, *rest in entries:
            if replica == self._me:
                continue
            if rest and rest[0]:
                self._apply_pins(rest[0], now)
            if len(rest) > 1 and rest[1] and self.load is not None:
                try:
                    self.load.apply_changes(replica.decode(errors="replace"), rest[1])
                except (msgspec.DecodeError, ValueError):
                    counters.malformed += 1
            if self.index is None:
                continue  # sessions only (the shared index keeps decisions in Redis)
            add = self.index.add_now
            try:
                decisions = decode_decisions(payload)
            except ValueError:
                counters.malformed += 1
                continue
            for endpoint, rank, ttl_ms, made_at, packed in decisions:
                engine = EngineKey(endpoint, rank)
                if known is not None and not known(engine):
                    counters.foreign += 1
                    continue
                try:
                    keys = unpack_keys(packed)
                except ValueError:
                    counters.malformed += 1
                    continue
                if not (math.isfinite(made_at) and 0 < ttl_ms <= MAX_TTL_S * 1000):
                    counters.malformed += 1
                    continue
                age = min(max(now - made_at, 0.0), MAX_TTL_S)
                left = ttl_ms / 1000.0 - age
                if left <= 0:
                    counters.expired += 1
                    continue
                if keys:
                    add(engine, keys, Tier.GPU, left)
                counters.applied += 1
                counters.delay_s = age

    def _apply_pins(self, raw: bytes, now: float) -> None:
        """Peers' session pins into :attr:`sessions`, with what is left of their life."""
        sessions = self.sessions
        if sessions is None:
            return
        counters = self.counters
        try:
            pins = _decode_pins(raw)
        except msgspec.DecodeError:
            counters.malformed += 1
            return
        known = self.known
        at = self.clock()
        for session, endpoint, rank, ttl_ms, made_at in pins:
            engine = EngineKey(endpoint, rank)
            if not (
                math.isfinite(made_at)
                and 0 < ttl_ms <= MAX_TTL_S * 1000
                and 0 < len(session) <= MAX_KEY_CHARS  # keys are kept short (hashed)
            ):
                counters.malformed += 1
                continue
            if known is not None and not known(engine):
                counters.foreign += 1
                continue
            left = ttl_ms / 1000.0 - min(max(now - made_at, 0.0), MAX_TTL_S)
            if left <= 0:
                counters.expired += 1
                continue
            sessions.learn(session, engine, at + left)
            counters.sessions_applied += 1


class ReplicatedIndex(MemoryIndex):
    """A :class:`MemoryIndex` whose decision records are shared with the other replicas.

    Firm records (engines' KV events) stay local: every replica follows the engines
    itself. Expiring records (``add`` with a ``ttl``: routing decisions) are recorded
    locally and published through :attr:`sync` (:attr:`MemoryIndex.on_record`); peers'
    come back through it.
    """

    def __init__(
        self,
        redis: RedisClient,
        config: ReplicatedIndexConfig,
        replica: str,
        *,
        max_entries: int = 0,
        max_entries_per_engine: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            clock=clock, max_entries=max_entries, max_entries_per_engine=max_entries_per_engine
        )
        self.redis = redis
        redis.outage_note = (
            "lookups go on from this replica's memory; decisions are shared again when it answers"
        )
        self.config = config
        self.replica = replica
        self.sync = DecisionSync(self, redis, config, replica)
        self.on_record = self.sync.publish

    def describe(self) -> str:
        return f"replicated (in memory; decisions through {self.redis.describe()})"

    def metric_families(self, snapshots: SnapshotWriter | None = None) -> Iterator[StateFamily]:
        """Decision sharing: published, applied, expired, dropped, failed, pending, the
        last peer decision's delay, and the ``snapshots`` writer's count (0 without one)."""
        sync = self.sync
        c = sync.counters
        yield REPLICA_SYNC_PUBLISHED.value(c.published)
        yield REPLICA_SYNC_ENTRIES.value(c.entries)
        yield REPLICA_SYNC_APPLIED.value(c.applied)
        yield REPLICA_SYNC_EXPIRED.value(c.expired)
        reasons = ("queue_full", "expired")
        yield REPLICA_SYNC_DROPPED.labelled(((r,), c.dropped.get(r, 0)) for r in reasons)
        yield c.errors_family()
        yield REPLICA_SYNC_PENDING.value(sync.pending)
        yield REPLICA_SNAPSHOTS_WRITTEN.value(snapshots.written if snapshots is not None else 0)
        yield REPLICA_SYNC_DELAY_SECONDS.value(c.delay_s)

    async def close(self) -> None:
        await self.sync.stop()
        await self.redis.close()
        await super().close()
