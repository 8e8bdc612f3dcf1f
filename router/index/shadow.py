"""A router's view of a shared (remote) index, with a local shadow of its own decisions.

:class:`ShadowedIndex` wraps a :class:`~router.index.remote.RemoteIndex` (Redis, say)
for a router:

* **Records are off the request path.** A decision's expiring record (``add`` with a
  ``ttl``) goes into the shadow at once and into a bounded queue that a background task
  writes to the remote index in batches; the request never waits for the remote to
  store it. Until a record is written, lookups merge it into the remote's answer, so a
  burst sharing a prefix follows its first request as it does with the memory index.
* **Lookups degrade.** While the remote index is unavailable or slower than its budget
  (``index.redis.budget_ms``), lookups are answered from the shadow: where this router
  recently sent each prefix. Routing goes on, on load and that, and no request fails
  because of the remote index.
* **Reconciliation.** When the remote answers again, the decisions whose records never
  reached it and are still live are written (every live one if it lost its data).
  Engines' own KV events are reconciled by whoever writes them (the router's event
  writer or the standalone indexer).

:class:`DecisionShadow` is the shadow: a bounded window of recent decisions. For
lookups it indexes every ``stride``-th key of a decision and its last one, not every
key: recording a 512-block prompt then costs about 10 µs instead of about 150 µs (a
dict store per block), and a depth found through it is exact to within ``stride``
blocks, which is all that routing on a fallback needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.index.base import FallbackMatches, IndexStats, IndexUnavailable, KVIndex, Match
from router.index.remote import ExpireOp, RemoteIndex, WriteBatch, take_for_write
from router.metric_catalogue import (
    INDEX_FALLBACKS,
    INDEX_OUTAGES,
    INDEX_REPLAYED_RECORDS,
    INDEX_SLOW_CALLS,
    INDEX_UNWRITTEN_RECORDS,
)
from router.types import EngineKey, Tier

if TYPE_CHECKING:
    from router.metric_catalogue import StateFamily

log = logging.getLogger("kvroute.index.shadow")


class _Decision:
    """One routing decision as the shadow keeps it."""

    __slots__ = ("at", "deadline", "engine", "keys", "marks", "written")

    def __init__(
        self,
        at: float,
        engine: EngineKey,
        keys: Sequence[int],
        deadline: float,
        marks: Sequence[int],
    ) -> None:
        self.at = at
        self.engine = engine
        self.keys = keys
        self.deadline = deadline
        """When its record in the shared index expires (shadow clock)."""
        self.marks = marks
        """The keys the shadow indexes it by."""
        self.written = False
        """Whether its record reached the remote index."""


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two chains of block keys. Key *i* stands for the
    whole prefix up to block *i*, so equality is monotone and a bisection finds it."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _with_unwritten(
    keys: Sequence[int],
    candidates: Sequence[EngineKey],
    matches: Mapping[EngineKey, Match],
    unwritten: Sequence[_Decision],
) -> Mapping[EngineKey, Match]:
    """The remote index's answer plus this router's records that it may not have yet."""
    merged: dict[EngineKey, Match] | None = None
    first = keys[0]
    for decision in unwritten:
        if decision.keys[0] != first or decision.engine not in candidates:
            continue
        depth = _common_prefix(keys, decision.keys)
        known = (matches if merged is None else merged).get(decision.engine)
        if known is None or known.blocks < depth:
            if merged is None:
                merged = dict(matches)
            merged[decision.engine] = Match(depth)
    return matches if merged is None else merged


class DecisionShadow:
    """This router's recent decisions, for lookups while the shared index is away.

    Decisions are kept for ``window`` seconds, and at most ``max_keys`` block keys in
    all (the oldest go first), so memory stays bounded whatever the request rate. Each
    prefix is credited to the engine it was most recently sent to.
    """

    def __init__(
        self,
        window: float = 60.0,
        max_keys: int = 1_000_000,
        stride: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window = window
        self.max_keys = max_keys
        self.stride = stride
        self._clock = clock
        self._decisions: deque[_Decision] = deque()
        self._marks: dict[int, _Decision] = {}
        """Every ``stride``-th key of each decision, and its last, -> latest decision."""
        self._keys = 0

    def __len__(self) -> int:
        return len(self._decisions)

    def record(self, engine: EngineKey, keys: Sequence[int], ttl: float) -> _Decision:
        """Remember that ``engine`` was sent ``keys``; its shared record lives ``ttl`` s."""
        now = self._clock()
        stride = self.stride
        marks = list(keys[stride - 1 :: stride])
        if len(keys) % stride:
            marks.append(keys[-1])
        decision = _Decision(now, engine, keys, now + ttl, marks)
        self._decisions.append(decision)
        self._marks.update(dict.fromkeys(marks, decision))
        self._keys += len(keys)
        self._trim(now)
        return decision

    def _trim(self, now: float) -> None:
        decisions, marks = self._decisions, self._marks
        oldest = now - self.window
        while decisions and (decisions[0].at <= oldest or self._keys > self.max_keys):
            gone = decisions.popleft()
            self._keys -= len(gone.keys)
            for key in gone.marks:
                if marks.get(key) is gone:
                    del marks[key]

    def lookup(
        self, keys: Sequence[int], candidates: Sequence[EngineKey]
    ) -> dict[EngineKey, Match]:
        """Match depths as far as this router's recent decisions tell."""
        if not keys or not self._decisions:
            return {}
        self._trim(self._clock())
        get = self._marks.get
        stride = self.stride
        depth: dict[EngineKey, int] = {}
        checked = 0
        # Every stride-th position first, stopping at the first one no decision marked
        # (marks of one decision cover a prefix: key i stands for blocks 0..i) ...
        for pos in range(stride - 1, len(keys), stride):
            decision = get(keys[pos])
            if decision is None:
                break
            depth[decision.engine] = pos + 1
            checked = pos + 1
        # ... then the positions up to the next one, where shorter decisions ended.
        for pos in range(checked, min(checked + stride - 1, len(keys))):
            decision = get(keys[pos])
            if decision is not None:
                depth[decision.engine] = pos + 1
        wanted = set(candidates)
        return {e: Match(d) for e, d in depth.items() if e in wanted}

    def live(self) -> list[_Decision]:
        """Decisions whose shared record has not expired yet, oldest first."""
        now = self._clock()
        return [d for d in self._decisions if d.deadline > now]

    def forget(self, engine: EngineKey) -> None:
        """Drop every decision for ``engine`` (its cache was cleared)."""
        kept = deque(d for d in self._decisions if d.engine != engine)
        self._decisions = kept
        self._keys = sum(len(d.keys) for d in kept)
        self._marks = {k: d for k, d in self._marks.items() if d.engine != engine}


@dataclass(slots=True)
class ShadowCounters:
    """What the shadowed index did, for metrics (never reset)."""

    fallbacks: int = 0
    """Lookups answered from the shadow (remote index unavailable or over budget)."""
    errors: int = 0
    """Remote calls of the request path that failed or ran over budget."""
    unwritten: int = 0
    """Decision records that did not reach the remote index when made (it was
    unavailable, the write failed, or the queue was full); the live ones are replayed
    when it returns."""
    replayed: int = 0
    """Decision records written to the remote index by reconciliation after an outage."""


class ShadowedIndex(KVIndex):
    """A router's :class:`KVIndex` over a remote one: off-path records, fallback,
    reconciliation.

    ``max_pending`` bounds the queue of records waiting for the remote (the oldest are left
    to the shadow when it overflows); ``max_flush`` and ``max_flush_keys`` bound one
    pipeline; ``write_timeout`` bounds one (it runs off the request path).
    """

    def __init__(
        self,
        remote: RemoteIndex,
        shadow: DecisionShadow | None = None,
        *,
        max_pending: int = 4096,
        max_flush: int = 256,
        max_flush_keys: int = 16_384,
        write_timeout: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.remote = remote
        self.shadow = shadow if shadow is not None else DecisionShadow(clock=clock)
        self.max_pending = max_pending
        self.max_flush = max_flush
        self.max_flush_keys = max_flush_keys
        self.write_timeout = write_timeout
        self.counters = ShadowCounters()
        self._clock = clock
        self._queue: deque[_Decision] = deque()
        self._sending: list[_Decision] = []
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self._replay: asyncio.Task[None] | None = None
        remote.listeners.append(self._on_availability)

    @property
    def available(self) -> bool:
        """Whether lookups are answered by the remote index (else by the shadow)."""
        return self.remote.available

    def metric_families(self) -> Iterator[StateFamily]:
        """The remote index's outages and slow calls, and what the shadow answered,
        could not write and wrote back."""
        yield INDEX_OUTAGES.value(self.remote.counters.outages)
        yield INDEX_SLOW_CALLS.value(self.remote.counters.slow_calls)
        yield INDEX_FALLBACKS.value(self.counters.fallbacks)
        yield INDEX_UNWRITTEN_RECORDS.value(self.counters.unwritten)
        yield INDEX_REPLAYED_RECORDS.value(self.counters.replayed)

    # ------------------------------------------------------------------ KVIndex

    async def lookup(
        self, keys: Sequence[int], candidates: Sequence[EngineKey]
    ) -> Mapping[EngineKey, Match]:
        why = "unavailable"  # the remote is marked down: not even tried
        if self.remote.available:
            # Records still on their way may reach the remote after it reads: take them as
            # they are now, before the round trip.
            unwritten = (*self._sending, *self._queue) if self._sending or self._queue else ()
            try:
                matches = await self.remote.lookup(keys, candidates)
            except IndexUnavailable as exc:
                self.counters.errors += 1
                why = exc.why
                log.debug("index lookup failed, answering from the shadow: %s", exc)
            else:
                if unwritten and keys:
                    return _with_unwritten(keys, candidates, matches, unwritten)
                return matches
        self.counters.fallbacks += 1
        return FallbackMatches(self.shadow.lookup(keys, candidates), f"shadow:{why}")

    async def add(
        self,
        engine: EngineKey,
        keys: Sequence[int],
        tier: Tier = Tier.GPU,
        ttl: float | None = None,
    ) -> None:
        """Firm records go to the remote index and are awaited; an expiring record (a
        decision) is kept in the shadow and queued for the remote, and this returns at
        once."""
        if not keys:
            return
        if ttl is None:
            await self.remote.add(engine, keys, tier)
            return
        decision = self.shadow.record(engine, keys, ttl)
        if not self.remote.available:
            self.counters.unwritten += 1
            return
        if len(self._queue) >= self.max_pending:
            self._queue.popleft()
            self.counters.unwritten += 1
        self._queue.append(decision)
        self._wake.set()
        if self._flusher is None:
            self._flusher = asyncio.ensure_future(self._flush_forever())

    async def remove(
        self, engine: EngineKey, keys: Sequence[int], tier: Tier | None = None
    ) -> None:
        await self.remote.remove(engine, keys, tier)

    async def clear(self, engine: EngineKey) -> None:
        self.shadow.forget(engine)
        await self.remote.clear(engine)

    async def stats(self) -> IndexStats:
        return await self.remote.stats()

    async def drain(self) -> None:
        """Wait until the records queued so far have been sent (written or not)."""
        while self._queue or self._sending:
            self._drained.clear()
            await self._drained.wait()

    async def close(self) -> None:
        """Send what is queued (for at most ``write_timeout``), then stop."""
        if self._on_availability in self.remote.listeners:
            self.remote.listeners.remove(self._on_availability)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.drain(), self.write_timeout)
        for task in (self._flusher, self._replay):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.remote.close()

    # ------------------------------------------------------------------ writing records

    async def _flush_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                self._sending = self._take()
                try:
                    if not await self._write(self._sending):
                        self.counters.unwritten += len(self._sending)
                except Exception:  # keep writing later records whatever this one did
                    log.exception("writing decision records failed")
                    self.counters.unwritten += len(self._sending)
                finally:
                    self._sending = []
            self._drained.set()

    def _take(self) -> list[_Decision]:
        return take_for_write(
            self._queue, self.max_flush, self.max_flush_keys, lambda d: len(d.keys)
        )

    async def _write(self, decisions: list[_Decision]) -> bool:
        """Write ``decisions``' records, one batch per engine, in one call; True if the
        remote index took them.

        A burst of requests sharing a prefix, routed to one engine while the previous
        pipeline was out, records that prefix once: newest first, each decision sends
        only the keys past what a newer one for the same engine, living at least as
        long, already covers (key *i* stands for the whole prefix up to block *i*, so
        the overlap is a common prefix).
        """
        now = self._clock()
        batches: dict[EngineKey, WriteBatch] = {}
        newer: dict[tuple[EngineKey, int], list[_Decision]] = {}
        sent: list[_Decision] = []
        for decision in reversed(decisions):
            # The record lives as long as it would have had it been written at once.
            ttl = decision.deadline - now
            if ttl <= 0:
                continue
            sent.append(decision)
            keys = decision.keys
            same_root = newer.setdefault((decision.engine, keys[0]), [])
            deadline = decision.deadline
            covered = max(
                (_common_prefix(keys, d.keys) for d in same_root if d.deadline >= deadline),
                default=0,
            )
            same_root.append(decision)
            if covered == len(keys):
                continue
            batch = batches.get(decision.engine)
            if batch is None:
                batch = batches[decision.engine] = WriteBatch(decision.engine, [])
            batch.ops.append(ExpireOp(keys[covered:] if covered else keys, ttl))
        if not batches:
            for decision in sent:
                decision.written = True
            return True
        try:
            await self.remote.write(list(batches.values()), timeout=self.write_timeout)
        except IndexUnavailable as exc:
            log.debug("could not write %d decision records: %s", len(sent), exc)
            return False
        for decision in sent:
            decision.written = True
        return True

    # ------------------------------------------------------------------ reconciliation

    def _on_availability(self, available: bool, data_lost: bool) -> None:
        if not available:
            # What is queued now would fail at once: leave it to the replay.
            self.counters.unwritten += len(self._queue)
            self._queue.clear()
            self._drained.set()
            return
        if data_lost:
            for decision in self.shadow.live():
                decision.written = False
        # A replay cut short by a flap is started over; it skips what it wrote.
        if self._replay is not None:
            self._replay.cancel()
        self._replay = asyncio.ensure_future(self._reconcile())

    async def _reconcile(self) -> None:
        """Write the live decisions the remote index does not have."""
        live = deque(d for d in self.shadow.live() if not d.written)
        written = 0
        while live and self.remote.available:
            chunk: list[_Decision] = []
            keys = 0
            while live and len(chunk) < self.max_flush and keys < self.max_flush_keys:
                decision = live.popleft()
                chunk.append(decision)
                keys += len(decision.keys)
            if not await self._write(chunk):
                break
            written += len(chunk)
        self.counters.replayed += written
        if written:
            log.info("replayed %d recent decisions into the shared index", written)
