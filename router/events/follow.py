"""The router following its engines' KV events: which streams, from where, and a shared
index kept whole.

The router follows every engine's stream itself unless events are off
(``events.enabled``) or a standalone ``kvroute indexer`` follows them
(``events.via_indexer``). An engine is subscribed once discovery says where it publishes
(connect mode), or its topic names it on the bound socket (``events.bind_endpoint``).

With a shared index (a :class:`~router.index.remote.RemoteIndex`) the events are written
through a batching :class:`~router.events.writer.RemoteEventWriter`. A stream whose
writes were lost is rewritten from what the subscriber knows its engine holds when the
index answers again (every stream, if the index lost its data), or a little later if the
index refused the writes while reachable.

In the replicated mode a stream starts from its engine's snapshot, loaded at start, when
one describes it (same model and block size): its blocks go into the index at once and
the stream replays only the batches after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from router.events.ingest import EventIngestor, StreamState
from router.events.publishers import CurveKeys, is_loopback
from router.events.subscriber import EventSource, KVEventSubscriber, parse_llmd_topic
from router.index.memory import MemoryIndex
from router.types import EngineKey, Tier

if TYPE_CHECKING:
    from router.config import Config, IndexConfig
    from router.events.snapshots import Snapshot
    from router.events.writer import RemoteEventWriter
    from router.fleet.block_size import BlockSizes
    from router.fleet.registry import Engine, Registry
    from router.index.base import KVIndex
    from router.index.remote import RemoteIndex
    from router.index.replicated import ReplicatedIndex
    from router.live_config import LiveConfig

log = logging.getLogger("kvroute")

#: Bound on one pipelined write of the router's own KV-event batches (off the request
#: path; a frozen Redis is noticed by lookups within the budget anyway).
EVENT_WRITE_TIMEOUT_S = 1.0


def map_bound(config: IndexConfig, index: KVIndex) -> int:
    """Engine hashes an event stream's map keeps per tier (0: no limit): at most
    ``index.max_entries_per_engine``, and with the in-memory index no more than it holds
    in all. The blocks of forgotten hashes leave the index with them."""
    caps = [config.max_entries_per_engine]
    if isinstance(index, MemoryIndex):
        caps.append(config.max_entries)
    return min((c for c in caps if c), default=0)


class EventFollowing:
    """The engines' KV-event streams this router follows, and what it does with them."""

    def __init__(
        self,
        live: LiveConfig,
        registry: Registry,
        index: KVIndex,
        block_sizes: BlockSizes,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        remote: RemoteIndex | None = None,
        replicated: ReplicatedIndex | None = None,
    ) -> None:
        """``spawn`` runs a background job owned by the router; ``remote`` is the shared
        index behind the shadow, ``replicated`` the replicated mode's index."""
        self.live = live
        self.registry = registry
        self.index = index
        self.block_sizes = block_sizes
        self.spawn = spawn
        self.remote = remote
        self.replicated = replicated
        self.writer = self._writer()
        """With a shared index, the batching writer the subscriber's events go through."""
        self.ingestor: EventIngestor = self.writer or EventIngestor(
            index,
            on_block_size_mismatch=block_sizes.event_mismatch,
            max_blocks_per_engine=map_bound(self.config.index, index),
        )
        self.subscriber: KVEventSubscriber | None = None
        """The subscriber, once started (None if this router does not follow events)."""
        self.warm: dict[EngineKey, Snapshot] = {}
        """Replicated mode: snapshots loaded at start, taken by each engine's first
        subscription."""
        self.resync_retry_s = 5.0
        """After Redis refused event writes while reachable, rewrite the streams then."""
        self._unsynced: set[EngineKey] = set()
        """Engine streams some of whose event batches never reached Redis."""
        self._resync_pending = False

    @property
    def config(self) -> Config:
        return self.live.current

    @property
    def subscribes(self) -> bool:
        """Whether this router follows the engines' KV events itself."""
        return self.config.events.enabled and not self.config.events.via_indexer

    def _writer(self) -> RemoteEventWriter | None:
        if self.remote is None or not self.subscribes:
            return None
        from router.events.writer import RemoteEventWriter

        # Unfenced: several replicas may write the same engine's events; the writes are
        # idempotent, and a standalone indexer is the fenced alternative.
        return RemoteEventWriter(
            self.remote,
            on_block_size_mismatch=self.block_sizes.event_mismatch,
            on_lost=self._writes_lost,
            write_timeout=EVENT_WRITE_TIMEOUT_S,
            max_blocks_per_engine=map_bound(self.config.index, self.index),
        )

    def has_events(self, key: EngineKey) -> bool:
        """Whether an engine's KV events reach the index (else it is tracked from
        decisions alone)."""
        if self.config.events.via_indexer:
            engine = self.registry.engine_of(key)
            return engine is not None and engine.wants_events
        if self.subscriber is None:
            return False
        return self.subscriber.stream_state(key) is not None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> KVEventSubscriber | None:
        """Open the subscriber if this router follows events, bound where engines
        connect if ``events.bind_endpoint`` says so; returns it."""
        if not self.subscribes:
            return None
        self.subscriber = KVEventSubscriber(
            self.ingestor,
            replay_timeout=self.config.events.replay_timeout_s,
            max_message_bytes=self.config.events.max_message_bytes,
        )
        if self.config.events.bind_endpoint:
            await self._bind(self.subscriber)
        return self.subscriber

    async def synced(self) -> None:
        """Wait for the first replays, and with a shared index for their writes: they
        land before any decision's record."""
        if self.subscriber is not None:
            await self.subscriber.wait_synced(self.config.events.replay_timeout_s * 2)
        await self._flush()

    async def close(self) -> None:
        """Stop following; write what the subscriber applied last, then stop writing."""
        if self.subscriber is not None:
            await self.subscriber.close()
        if self.writer is not None:
            await self._flush()
            await self.writer.close()

    async def _flush(self) -> None:
        if self.writer is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.writer.drain(), EVENT_WRITE_TIMEOUT_S)

    # ------------------------------------------------------------------ engines

    async def subscribe(self, engine: Engine) -> None:
        """Follow an engine's KV events once discovery says where they are."""
        if self.subscriber is None or engine.events is None:
            return
        bases = self.registry.base_models(engine)
        if not bases:
            return
        for key in engine.keys:
            if self.subscriber.stream_state(key) is not None:
                continue
            endpoints = engine.events_of(key.rank)
            if endpoints is None:
                continue
            source = EventSource(
                engine=key,
                namespace=bases[0],
                endpoint=endpoints.endpoint,
                replay_endpoint=endpoints.replay_endpoint,
                topic=endpoints.topic,
                block_size=self.block_sizes.of(bases[0]),
            )
            warm = self._warm_start(source)
            if warm is None:
                await self.subscriber.add_source(source)
            else:
                await self.subscriber.add_source(source, warm.state, warm.digest)
            log.info(
                "following KV events of %s at %s%s",
                key.label,
                endpoints.endpoint,
                "" if warm is None else f" from its snapshot's batch {warm.state.last_seq}",
            )

    async def drop(self, key: EngineKey) -> None:
        """Stop following an engine stream and clear its index entries."""
        if self.subscriber is not None:
            await self.subscriber.remove_source(key, clear=True)

    def readmitted(self, engine: Engine) -> None:
        """An engine came back from an ejection: its streams resync (it may have
        restarted)."""
        if self.subscriber is not None:
            for key in engine.keys:
                self.subscriber.resync(key)

    def _warm_start(self, source: EventSource) -> Snapshot | None:
        """Replicated mode: the engine's stored snapshot, its blocks put in the index, if
        one was loaded at start and describes this stream (same model and block size)."""
        warm = self.warm.pop(source.engine, None)
        if warm is None or self.replicated is None:
            return None
        state = warm.state
        if state.namespace != source.namespace or (
            source.block_size is not None
            and state.block_size is not None
            and state.block_size != source.block_size
        ):
            log.info("not using the snapshot of %s: another model or block size", state.engine)
            return None
        if source.replay_endpoint is None:
            return None  # nothing would bring it up to date: follow from new events
        state.block_size = state.block_size or source.block_size
        for tier, table in zip(Tier, state.hashes, strict=True):
            keys = table.values()
            if keys:
                self.replicated.add_now(source.engine, list(keys), tier)
        return warm

    def stream_states(self) -> list[tuple[StreamState, int | None]]:
        """Every stream followed, with the digest of the last batch applied (what a
        snapshot of it holds)."""
        subscriber = self.subscriber
        if subscriber is None:
            return []
        return [(s, subscriber.digest_of(s.engine)) for s in subscriber.states()]

    async def _bind(self, subscriber: KVEventSubscriber) -> None:
        """Bind the socket engines publish to (``events.bind_endpoint``), with the
        publisher checks configured; warn when it is open beyond loopback without keys."""
        events = self.config.events
        assert events.bind_endpoint is not None
        curve = None
        if events.curve_secret_key_file is not None and events.curve_public_keys_dir:
            curve = CurveKeys.load(events.curve_secret_key_file, events.curve_public_keys_dir)
        bound = await subscriber.bind(
            events.bind_endpoint,
            self._resolve_topic,
            check_address=events.bind_check_address,
            curve=curve,
        )
        log.info("KV events: bound %s for engines that connect", bound)
        if curve is None and not is_loopback(bound):
            log.warning(
                "KV events: %s takes publishers from any host that reaches it, without "
                "CURVE keys; %s. Set events.curve_secret_key_file and "
                "events.curve_public_keys_dir (docs/security.md)",
                bound,
                "a message counts only if it comes from the address of the engine its topic "
                "names (events.bind_check_address)"
                if events.bind_check_address
                else "and events.bind_check_address is off: any of them may post under any "
                "engine's topic",
            )

    def _resolve_topic(self, topic: str, rank: int | None) -> EventSource | None:
        parsed = parse_llmd_topic(topic)
        if parsed is None:
            return None
        endpoint, model = parsed
        engine = self.registry.get(endpoint)
        if engine is None:
            return None
        return EventSource(
            EngineKey(endpoint, rank or 0), model, block_size=self.block_sizes.of(model)
        )

    # ------------------------------------------------------------------ shared index

    def on_index_availability(self, available: bool, data_lost: bool) -> None:
        """The shared index's availability listener: rewrite the streams it missed."""
        if available:
            self.resync_streams(data_lost)

    def _writes_lost(self, engine: EngineKey, reason: str) -> None:
        # Unfenced writes fail only when the index does; the stream is rewritten from
        # what the subscriber knows the engine holds once it answers again. If it
        # answered with an error instead (Redis out of memory, say), no return will be
        # announced: try again a little later.
        self._unsynced.add(engine)
        if self.remote is not None and self.remote.available and not self._resync_pending:
            self._resync_pending = True
            self.spawn(self._resync_later())

    async def _resync_later(self) -> None:
        try:
            await asyncio.sleep(self.resync_retry_s)
        finally:
            self._resync_pending = False
        if self.remote is not None and self.remote.available:
            self.resync_streams(data_lost=False)

    def resync_streams(self, data_lost: bool) -> None:
        """Rewrite into the shared index the engine streams whose writes were lost (every
        stream this router follows, if it lost its data)."""
        writer = self.writer
        if self.subscriber is None or writer is None:
            return
        states = [s for s in self.subscriber.states() if data_lost or s.engine in self._unsynced]
        self._unsynced.clear()
        for state in states:
            writer.resnapshot(state)
        if states:
            log.warning(
                "shared index: rewriting the entries of %d engine stream(s) from their "
                "KV events (%s)",
                len(states),
                "it lost its data" if data_lost else "writes were lost in the outage",
            )
