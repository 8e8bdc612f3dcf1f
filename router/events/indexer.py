"""``kvroute indexer``: keep the shared index true from the engines' KV events.

Routers can then run with events off and read the shared index only. The indexer
works on any :class:`~router.index.remote.FencedIndex` (Redis is the one shipped).
Several indexers may run for availability: each engine stream has one writer at a
time, the holder of the stream's lease (in Redis ``SET NX PX``, renewed every
``renew_ms``). Every write carries the lease token and the stream's sequence number;
the index refuses a stale token and an already-applied sequence, and records the
position it reached.

A writer that takes a stream over (at start, after another writer died, or after the
index failed under it) reads the position and the engine-hash -> block-key maps from
the index. If the engine still has the last applied batch, with the same timestamp (the
same engine life, not a restart that reused the numbers), it resumes: replay from the
next sequence number, removals of earlier blocks still apply. Otherwise it rebuilds:
the engine's entries are dropped and replayed from the start of the engine's buffer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio

from router.config import (
    MAX_EVENT_MESSAGE_BYTES,
    Config,
    ConfigError,
    IndexerConfig,
    load_config,
)
from router.events.ingest import StreamState
from router.events.subscriber import EventSource, KVEventSubscriber
from router.events.vllm import (
    END_SEQ,
    EventDecodeError,
    decode_batch,
    decode_seq,
    encode_seq,
    replay_reply,
)
from router.events.writer import RemoteEventWriter
from router.index.base import IndexUnavailable
from router.index.remote import FencedIndex, StreamPosition
from router.types import EngineKey

log = logging.getLogger("kvroute.indexer")


@dataclass(slots=True)
class IndexerStats:
    """What the indexer did, for logs and tests (never reset)."""

    takeovers: int = 0
    """Streams this process started writing."""
    resumed: int = 0
    """Takeovers that continued from the position recorded in Redis."""
    rebuilt: int = 0
    """Takeovers that dropped the engine's entries and replayed from scratch."""
    lost: int = 0
    """Streams given up: lease lost, or the index failed under the writes."""


class Indexer:
    """Follows engine streams and writes the shared index, one lease per stream.

    ``token`` identifies this writer in leases (unique per process by default).
    ``renew_ms`` defaults to a third of ``lease_ms``.
    """

    def __init__(
        self,
        index: FencedIndex,
        sources: Sequence[EventSource],
        *,
        lease_ms: int = 5000,
        renew_ms: int | None = None,
        replay_timeout: float = 2.0,
        write_timeout: float = 5.0,
        token: str | None = None,
        ctx: zmq.asyncio.Context | None = None,
        max_message_bytes: int = MAX_EVENT_MESSAGE_BYTES,
        max_blocks_per_engine: int = 0,
    ) -> None:
        """``max_blocks_per_engine``: ``index.max_entries_per_engine`` (0: no limit)."""
        self.index = index
        self.sources = {s.engine: s for s in sources}
        self.lease_ms = lease_ms
        self.renew = (renew_ms or max(lease_ms // 3, 1)) / 1000.0
        self.replay_timeout = replay_timeout
        self.token = token or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.writer = RemoteEventWriter(
            index,
            token=self.token,
            on_lost=self._on_lost,
            write_timeout=write_timeout,
            max_blocks_per_engine=max_blocks_per_engine,
        )
        self.subscriber = KVEventSubscriber(
            self.writer,
            ctx=self.ctx,
            replay_timeout=replay_timeout,
            max_message_bytes=max_message_bytes,
        )
        self.owned: set[EngineKey] = set()
        """Streams this process holds the lease of and writes."""
        self.stats = IndexerStats()
        self._lost: set[EngineKey] = set()
        self._renewed: dict[EngineKey, float] = {}
        self._wakes = {engine: asyncio.Event() for engine in self.sources}
        self._tried: set[EngineKey] = set()
        self._first_round = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Start tending every stream; returns once each has been tried once."""
        self._tasks = [asyncio.ensure_future(self._tend(s)) for s in self.sources.values()]
        if not self.sources:
            self._first_round.set()
        await self._first_round.wait()

    async def stop(self, drain_timeout: float = 5.0) -> None:
        """Stop following, write what is queued, and hand the leases back."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        owned = list(self.owned)
        for engine in owned:
            await self.subscriber.remove_source(engine)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.writer.drain(), drain_timeout)
        for engine in owned:
            with contextlib.suppress(IndexUnavailable):
                await self.index.lease(engine, self.token, self.lease_ms, "release")
        self.owned.clear()
        await self.subscriber.close()
        await self.writer.close()

    # ------------------------------------------------------------------ per stream

    async def _tend(self, source: EventSource) -> None:
        engine = source.engine
        while True:
            try:
                await self._step(source)
            except IndexUnavailable as exc:
                log.debug("%s: index unavailable: %s", engine.label, exc)
                # Renewals failing: past the lease's life another writer may hold it.
                renewed = self._renewed.get(engine, 0.0)
                if engine in self.owned and time.monotonic() - renewed > self.lease_ms / 1000:
                    await self._drop(engine, "lease lapsed while the index was unreachable")
            except asyncio.CancelledError:
                raise
            except Exception:  # keep tending whatever an engine or the index does
                log.exception("%s: tending the stream failed", engine.label)
            self._tried.add(engine)
            if len(self._tried) == len(self.sources):
                self._first_round.set()
            wake = self._wakes[engine]
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), self.renew)
            wake.clear()

    async def _step(self, source: EventSource) -> None:
        engine = source.engine
        if engine in self._lost:
            await self._drop(engine, "writes failed")
        # A lease call slower than the renewal interval is as good as failed.
        if engine in self.owned:
            if await self.index.lease(engine, self.token, self.lease_ms, "renew", self.renew):
                self._renewed[engine] = time.monotonic()
            else:
                await self._drop(engine, "lease taken by another writer")
        elif await self.index.lease(engine, self.token, self.lease_ms, "acquire", self.renew):
            self._renewed[engine] = time.monotonic()
            await self._take_over(source)

    async def _take_over(self, source: EventSource) -> None:
        engine = source.engine
        position = await self.index.stream_position(engine)
        state = StreamState(engine, source.namespace, source.block_size)
        self.stats.takeovers += 1
        if position.seq is not None and await self._same_engine_life(source, position):
            for mine, stored in zip(state.hashes, position.hashes, strict=True):
                mine.update(stored)
            state.last_seq = position.seq
            self.stats.resumed += 1
            log.info("%s: resuming after batch %d", engine.label, position.seq)
        else:
            await self.writer.clear(state)
            self.stats.rebuilt += 1
            log.info("%s: rebuilding the engine's entries from its events", engine.label)
        self.owned.add(engine)
        await self.subscriber.add_source(source, state)

    async def _same_engine_life(self, source: EventSource, position: StreamPosition) -> bool:
        """Whether the engine still has the last applied batch as it was applied."""
        if source.replay_endpoint is None:
            return False
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.subscriber.max_message_bytes)
        try:
            sock.connect(source.replay_endpoint)
            await sock.send_multipart([b"", encode_seq(position.seq or 0)])
            if not await sock.poll(int(self.replay_timeout * 1000), zmq.POLLIN):
                return False
            reply = replay_reply(await sock.recv_multipart())  # either release's frames
            if reply is None or reply[0] == END_SEQ:
                return False
            seq, payload = reply
            return decode_seq(seq) == position.seq and decode_batch(payload).ts == position.ts
        except EventDecodeError:
            return False
        finally:
            sock.close(0)

    async def _drop(self, engine: EngineKey, reason: str) -> None:
        self._lost.discard(engine)
        if engine not in self.owned:
            return
        self.owned.discard(engine)
        self.stats.lost += 1
        log.warning("%s: stopped writing (%s)", engine.label, reason)
        await self.subscriber.remove_source(engine)
        self.writer.discard(engine)

    def _on_lost(self, engine: EngineKey, reason: str) -> None:
        self._lost.add(engine)
        wake = self._wakes.get(engine)
        if wake is not None:
            wake.set()


# --------------------------------------------------------------------------- command


def sources_from_config(config: Config) -> list[EventSource]:
    """The event sources the ``indexer.engines`` section lists."""
    return [
        EventSource(
            EngineKey(e.endpoint, e.rank),
            e.model,
            e.events,
            e.replay,
            e.topic,
            e.block_size or config.block_size,
        )
        for e in config.indexer.engines
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", metavar="FILE", help="YAML with `index` (backend redis) and `indexer` sections"
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (default info)",
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"kvroute indexer: {exc}", file=sys.stderr)
        return 2
    for note in config.deprecations:
        log.warning("%s", note)
    if config.index.backend not in FENCED_BACKENDS:
        print(
            f"kvroute indexer: index.backend must be one of {', '.join(FENCED_BACKENDS)} "
            "(a shared index with writer leases)",
            file=sys.stderr,
        )
        return 2
    if not config.indexer.engines:
        print("kvroute indexer: indexer.engines lists no engine", file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(config))
    else:
        uvloop.run(_serve(config))
    return 0


FENCED_BACKENDS = ("redis",)
"""``index.backend`` values the indexer can write (a :class:`FencedIndex` each)."""


def fenced_index(config: Config) -> FencedIndex:
    """The shared index the ``index`` section selects, for the indexer's fenced writes."""
    if config.index.backend == "redis":
        from router.index.redis import RedisIndex

        # Calls without their own bound (stream positions) get the write timeout.
        timeout = config.indexer.write_timeout_s
        return RedisIndex.from_config(config.index.redis, admin_timeout=timeout)
    raise ConfigError(f"index.backend {config.index.backend!r} has no writer leases")


async def _serve(config: Config) -> None:
    settings: IndexerConfig = config.indexer
    index = fenced_index(config)
    indexer = Indexer(
        index,
        sources_from_config(config),
        lease_ms=settings.lease_ms,
        renew_ms=settings.renew_ms,
        replay_timeout=settings.replay_timeout_s,
        write_timeout=settings.write_timeout_s,
        max_message_bytes=config.events.max_message_bytes,
        max_blocks_per_engine=config.index.max_entries_per_engine,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await indexer.start()
        print(
            f"kvroute indexer listening for KV events of {len(indexer.sources)} engine streams "
            f"({len(indexer.owned)} leased here), writing {index.describe()}",
            flush=True,
        )
        await stop.wait()
    finally:
        await indexer.stop()
        await index.close()
        log.info(
            "stopped: %d takeovers (%d resumed, %d rebuilt), %d batches written",
            indexer.stats.takeovers,
            indexer.stats.resumed,
            indexer.stats.rebuilt,
            indexer.writer.stats.batches,
        )
