"""Write KV-event batches to a shared (remote) index: one atomic write per batch, batched.

An :class:`EventIngestor` turns each event of a batch into index calls; awaited one by
one against a remote index, that is a round trip per event. :class:`RemoteEventWriter`
records the calls of a whole batch instead and queues them as one :class:`WriteBatch`;
a background task sends everything queued in one :meth:`RemoteIndex.write` (one Redis
pipeline), so ingest is bounded by the backend, not by round trips. Submitting returns
once the batch is queued (it waits only when the queue is full).

With a lease ``token`` (the standalone indexer; the index must be a
:class:`~router.index.remote.FencedIndex`), every batch is fenced: the backend applies
it only while the token holds the engine's lease and its sequence number is new, and
records the position so that the next writer can resume there. The engine's own block
hashes travel with stored blocks for the same reason. When the backend fails or
refuses a stale token, the engine's queued batches are dropped and ``on_lost`` is
told: the stream must be resumed from the position the backend recorded. An unfenced
writer (a router's own subscriber) cannot resume from a position; it rewrites the
engine's entries from what the stream's state says the engine holds
(:meth:`RemoteEventWriter.resnapshot`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.events.ingest import BlockSizeListener, EventIngestor, IngestCounters, StreamState
from router.events.types import EventBatch
from router.index.base import IndexStats, IndexUnavailable, KVIndex, Match
from router.index.remote import (
    AddOp,
    ClearOp,
    ExpireOp,
    Fence,
    FencedIndex,
    RemoteIndex,
    RemoveOp,
    WriteBatch,
    WriteOp,
    WriteResult,
    take_for_write,
)
from router.metric_catalogue import KV_EVENT_RESNAPSHOTS
from router.types import EngineKey, Tier

if TYPE_CHECKING:
    from router.metric_catalogue import StateFamily

log = logging.getLogger("kvroute.events.writer")

LostListener = Callable[[EngineKey, str], None]
"""Called with (engine, reason) when an engine's writes failed: ``unavailable`` (the
index failed; some of the batches may have been applied), ``stale_token`` (another
writer holds the engine's lease) or ``old_seq`` (the index is ahead of this writer's
view, say a write it gave up on was applied late)."""


@dataclass(slots=True)
class WriterStats:
    """What the writer did, for metrics (never reset)."""

    batches: int = 0
    """Batches the index applied."""
    flushes: int = 0
    """Writes sent (a Redis pipeline each)."""
    old_seq: int = 0
    """Batches refused because their sequence number was already applied."""
    stale_token: int = 0
    """Batches refused because another writer holds the lease."""
    failures: int = 0
    """Writes that failed (the index unavailable or slower than the write timeout)."""
    resnapshots: int = 0
    """Engine streams rewritten whole from their state (after writes were lost)."""

    def metric_families(self) -> Iterator[StateFamily]:
        """Engine streams rewritten into Redis."""
        yield KV_EVENT_RESNAPSHOTS.value(self.resnapshots)


class _Recorder(KVIndex):
    """Collects the index calls of one event batch instead of making them."""

    def __init__(self) -> None:
        self.ops: list[WriteOp] = []

    async def lookup(
        self, keys: Sequence[int], candidates: Sequence[EngineKey]
    ) -> Mapping[EngineKey, Match]:
        raise TypeError("the batch recorder only records writes")

    async def add(
        self,
        engine: EngineKey,
        keys: Sequence[int],
        tier: Tier = Tier.GPU,
        ttl: float | None = None,
    ) -> None:
        self.ops.append(AddOp(keys, tier) if ttl is None else ExpireOp(keys, ttl))

    async def remove(
        self, engine: EngineKey, keys: Sequence[int], tier: Tier | None = None
    ) -> None:
        self.ops.append(RemoveOp(keys, tier))

    async def clear(self, engine: EngineKey) -> None:
        self.ops.append(ClearOp())

    async def stats(self) -> IndexStats:
        raise TypeError("the batch recorder only records writes")


class _RecordingIngestor(EventIngestor):
    """An ingestor over a :class:`_Recorder` that keeps engine hashes with stored blocks."""

    index: _Recorder

    async def _store(
        self, state: StreamState, hashes: list[int], keys: list[int], tier: Tier
    ) -> None:
        self.index.ops.append(AddOp(keys, tier, hashes))


class RemoteEventWriter(EventIngestor):
    """An :class:`EventIngestor` for a remote index that writes each batch atomically.

    ``token`` fences every write with the engine's lease (None: unfenced, for a router
    that ingests events itself); it needs a :class:`FencedIndex`. ``max_pending``
    bounds the queue in batches; ``max_flush`` and ``max_flush_keys`` bound one write,
    so one flush cannot hold the backend (and the lookups waiting on it) for long;
    ``write_timeout`` bounds a flush.
    """

    def __init__(
        self,
        index: RemoteIndex,
        *,
        token: str | None = None,
        counters: IngestCounters | None = None,
        on_block_size_mismatch: BlockSizeListener | None = None,
        on_lost: LostListener | None = None,
        max_pending: int = 20_000,
        max_flush: int = 256,
        max_flush_keys: int = 8192,
        write_timeout: float = 5.0,
        max_blocks_per_engine: int = 0,
    ) -> None:
        """``max_blocks_per_engine``: engine hashes a stream's map keeps per tier (0: no
        limit); the blocks of those it forgets are removed from the index too."""
        if token is not None and not isinstance(index, FencedIndex):
            raise TypeError(f"fenced writes need a FencedIndex, not {type(index).__name__}")
        super().__init__(
            index, counters, on_block_size_mismatch, max_blocks_per_engine=max_blocks_per_engine
        )
        self.remote = index
        self.token = token
        self.on_lost = on_lost
        self.max_pending = max_pending
        self.max_flush = max_flush
        self.max_flush_keys = max_flush_keys
        self.write_timeout = write_timeout
        self.stats = WriterStats()
        self._queue: deque[WriteBatch] = deque()
        self._wake = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    async def apply(self, state: StreamState, batch: EventBatch) -> None:
        """Queue ``batch`` as one write (fenced with ``state.last_seq`` and its timestamp)."""
        recorder = _Recorder()
        await _RecordingIngestor(
            recorder, self.counters, self._on_mismatch, self.max_blocks_per_engine
        ).apply(state, batch)
        fence = None if self.token is None else Fence(self.token, state.last_seq, batch.ts)
        # A fenced batch is written even without index changes: it advances the position.
        if recorder.ops or fence is not None:
            await self._submit(WriteBatch(state.engine, recorder.ops, fence))

    async def clear(self, state: StreamState) -> None:
        """Queue dropping everything the engine holds; a fenced clear also forgets the
        stream position (the subscriber clears when the stream starts over)."""
        state.forget_blocks()
        fence = None if self.token is None else Fence(self.token, None)
        await self._submit(WriteBatch(state.engine, [ClearOp()], fence))

    def resnapshot(self, state: StreamState, chunk: int = 1024) -> None:
        """Queue a rewrite of the engine's entries from ``state``: a clear, then every
        block its stream says the engine holds, ``chunk`` keys per batch (so that
        lookups are not held up behind one long call). Unfenced writers only.

        For when some of this writer's batches never reached the index, or it lost its
        data: ``state`` is current (the stream applies every batch to it whether or not
        the write succeeds), so the rewrite supersedes the engine's queued batches, and
        batches applied after it is queued land on top of it.
        """
        if self.token is not None:
            raise ValueError("a fenced writer resumes from the stream position instead")
        engine = state.engine
        self.discard(engine)
        batches = [WriteBatch(engine, [ClearOp()])]
        for tier, table in zip(Tier, state.hashes, strict=True):
            held = list(table.items())
            for start in range(0, len(held), chunk):
                part = held[start : start + chunk]
                hashes = [h for h, _ in part]
                batches.append(WriteBatch(engine, [AddOp([k for _, k in part], tier, hashes)]))
        # Queued as one unit, past max_pending: a rewrite cut short would leave the engine
        # half cleared.
        self._queue.extend(batches)
        self.stats.resnapshots += 1
        self._idle.clear()
        self._wake.set()
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    def discard(self, engine: EngineKey) -> None:
        """Drop ``engine``'s queued batches (its stream stopped or moved to another writer)."""
        if any(b.engine == engine for b in self._queue):
            self._queue = deque(b for b in self._queue if b.engine != engine)
            self._space.set()

    async def drain(self) -> None:
        """Wait until every queued batch has been sent (applied, refused or failed)."""
        await self._idle.wait()

    async def close(self) -> None:
        """Stop the background flusher; queued batches are dropped (drain first to keep them)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._queue.clear()
        self._idle.set()

    # ------------------------------------------------------------------ flushing

    async def _submit(self, batch: WriteBatch) -> None:
        while len(self._queue) >= self.max_pending:
            self._space.clear()
            await self._space.wait()
        self._queue.append(batch)
        self._idle.clear()
        self._wake.set()
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                await self._flush(self._take())
                self._space.set()
            self._idle.set()

    def _take(self) -> list[WriteBatch]:
        return take_for_write(
            self._queue,
            self.max_flush,
            self.max_flush_keys,
            lambda batch: sum(len(op.keys) for op in batch.ops if not isinstance(op, ClearOp)),
        )

    async def _flush(self, batches: list[WriteBatch]) -> None:
        self.stats.flushes += 1
        try:
            results = await self.remote.write(batches, timeout=self.write_timeout)
        except IndexUnavailable as exc:
            self.stats.failures += 1
            # Once per run of failures: in an outage every batch fails, at once.
            log.log(
                logging.DEBUG if self._failing else logging.WARNING,
                "writing %d event batches to the shared index failed: %s",
                len(batches),
                exc,
            )
            self._failing = True
            for engine in dict.fromkeys(b.engine for b in batches):
                self._lose(engine, "unavailable")
            return
        self._failing = False
        refused: dict[EngineKey, str] = {}
        for batch, result in zip(batches, results, strict=True):
            if result is WriteResult.APPLIED:
                self.stats.batches += 1
            elif result is WriteResult.OLD_SEQ:
                self.stats.old_seq += 1
                refused.setdefault(batch.engine, "old_seq")
            else:
                self.stats.stale_token += 1
                refused[batch.engine] = "stale_token"
        for engine, reason in refused.items():
            self._lose(engine, reason)

    def _lose(self, engine: EngineKey, reason: str) -> None:
        self.discard(engine)
        if self.on_lost is not None:
            self.on_lost(engine, reason)
