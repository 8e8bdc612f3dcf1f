"""Snapshots of engine event streams in Redis, for the replicated mode's warm start.

A snapshot is what a router knows of one engine stream (DP rank): the engine-hash ->
block-key maps of each tier (what the engine holds), the last batch's sequence number
and the digest of that batch. One replica, elected by a lease, writes them
(:class:`SnapshotWriter`); a replica that starts loads them (:func:`load_snapshots`),
puts their blocks in its index and follows each engine from the snapshot's batch: the
subscriber's replay checks the engine still holds that very batch (else it restarted,
and the stream is rebuilt) and applies only the newer ones. docs/redis-schema.md
"Replicated mode" has the key layout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from router.events.ingest import StreamState, hash_maps
from router.index.base import IndexUnavailable, store_newest
from router.index.replicated import unpack_keys
from router.redis.client import RedisClient
from router.redis.schema import pack_keys
from router.redis.snapshot_store import SnapshotStore
from router.types import EngineKey, Tier

log = logging.getLogger("kvroute.events.snapshots")

_encode = msgspec.msgpack.Encoder().encode

_Snapshot = tuple[str, int, str, int, int, int, list[int], list[bytes], float]
"""(endpoint, rank, namespace, block size (0: unknown), last seq, last batch digest,
ignored groups, per tier the packed engine hashes then the packed keys (GPU, CPU, disk:
six strings), saved at (wall clock))."""
_decode_snapshot = msgspec.msgpack.Decoder(_Snapshot).decode


def encode_snapshot(state: StreamState, digest: int, saved_at: float) -> bytes:
    """One engine stream's state as :class:`SnapshotWriter` stores it."""
    tables: list[bytes] = []
    for table in state.hashes:
        tables.append(pack_keys(list(table.keys())))
        tables.append(pack_keys(list(table.values())))
    return _encode(
        (
            state.engine.endpoint,
            state.engine.rank,
            state.namespace,
            state.block_size or 0,
            state.last_seq if state.last_seq is not None else -1,
            digest,
            sorted(state.ignored_groups),
            tables,
            saved_at,
        )
    )


@dataclass(slots=True)
class Snapshot:
    """A stored engine stream state, decoded."""

    state: StreamState
    digest: int
    saved_at: float


def decode_snapshot(raw: bytes) -> Snapshot:
    """The inverse of :func:`encode_snapshot` (``ValueError`` when malformed)."""
    try:
        endpoint, rank, namespace, block_size, seq, digest, ignored, tables, saved_at = (
            _decode_snapshot(raw)
        )
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed snapshot: {exc}") from exc
    if len(tables) != 2 * len(Tier) or seq < 0:
        raise ValueError("malformed snapshot: wrong tables or no batch")
    state = StreamState(EngineKey(endpoint, rank), namespace, block_size or None)
    state.hashes = hash_maps()
    for tier in Tier:
        hashes = unpack_keys(tables[2 * tier])
        keys = unpack_keys(tables[2 * tier + 1])
        if len(hashes) != len(keys):
            raise ValueError("malformed snapshot: hashes and keys differ in number")
        store_newest(state.hashes[tier], list(hashes), list(keys), reorder=False)
    state.ignored_groups = set(ignored)
    state.last_seq = seq
    return Snapshot(state, digest, saved_at)


async def load_snapshots(
    redis: RedisClient, timeout: float | None = None
) -> dict[EngineKey, Snapshot]:
    """Every engine stream snapshot Redis holds (malformed ones are skipped), read one
    engine at a time."""
    store = SnapshotStore(redis)
    found: dict[EngineKey, Snapshot] = {}
    for label in await store.labels(timeout):
        raw = await store.load(label, timeout)
        if raw is None:
            continue  # deleted meanwhile
        try:
            snap = decode_snapshot(raw)
        except (ValueError, TypeError) as exc:
            log.warning("ignoring the stored snapshot of %s: %s", label, exc)
            continue
        found[snap.state.engine] = snap
    return found


STALE_INTERVALS = 10
"""A stored snapshot whose engine no lease holder has followed for this many intervals
(and at least :data:`STALE_MIN_S`) is deleted: the engine left the fleet."""
STALE_MIN_S = 600.0


class SnapshotWriter:
    """Writes the engine streams' states to Redis every ``interval`` seconds, while this
    replica holds the snapshot lease (one replica writes; another takes over when its
    lease lapses). Only streams that moved since the last write are written, one engine
    at a time so that the event loop is never held long."""

    def __init__(
        self,
        redis: RedisClient,
        replica: str,
        interval: float,
        streams: Callable[[], Sequence[tuple[StreamState, int | None]]],
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.store = SnapshotStore(redis)
        self.replica = replica
        self.interval = interval
        self.streams = streams
        """The streams followed now, with their last batch's digest."""
        self.wall = wall
        self.holder = False
        """Whether this replica held the lease at its last attempt."""
        self.written = 0
        """Engine snapshots written (for metrics and tests)."""
        self._saved: dict[str, tuple[int, int]] = {}
        """Engine label -> (sequence number, digest) of the snapshot this writer stored."""
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None and self.interval > 0:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.holder:
            with contextlib.suppress(IndexUnavailable):
                await self.store.claim(self.replica, 1, release=True)
            self.holder = False

    async def _run(self) -> None:
        while True:
            try:
                await self.write_once()
            except IndexUnavailable as exc:
                log.debug("writing engine snapshots failed: %s", exc)
            except Exception:  # a bug must not end snapshots
                log.exception("writing engine snapshots failed")
            await asyncio.sleep(self.interval)

    async def write_once(self) -> int:
        """Claim (or keep) the lease, write the streams that moved, note the engines
        followed and delete the snapshots of engines nobody has followed for long;
        returns how many snapshots it wrote."""
        ttl_ms = max(int(self.interval * 3000), 1000)
        self.holder = await self.store.claim(self.replica, ttl_ms)
        if not self.holder:
            self._saved.clear()  # another replica writes; start afresh if it ever lapses
            return 0
        # What Redis holds now: after it lost its data, every stream is written again.
        stored = set(await self.store.labels())
        self._saved = {k: v for k, v in self._saved.items() if k in stored}
        streams = list(self.streams())
        # Marked before written: a snapshot stored is never without its mark, even if
        # this round fails halfway or another replica takes the lease meanwhile.
        now_ms = int(self.wall() * 1000)
        await self.store.mark_seen([s.engine.label for s, _ in streams], now_ms)
        written = 0
        for state, digest in streams:
            label = state.engine.label
            if state.last_seq is None or digest is None:
                continue
            # The digest too: an engine that restarted may reach the same number again.
            position = (state.last_seq, digest)
            if self._saved.get(label) == position:
                continue
            await self.store.save(label, encode_snapshot(state, digest, self.wall()))
            self._saved[label] = position
            written += 1
        stale_s = max(self.interval * STALE_INTERVALS, STALE_MIN_S)
        for label in await self.store.drop_stale(now_ms - int(stale_s * 1000)):
            self._saved.pop(label, None)
        self.written += written
        return written
