"""Subscribe to engines' KV-event streams and keep the index true.

Two topologies, as vLLM decides by its endpoint:

* **connect** (vLLM binds its PUB): one SUB socket per engine stream, connected to the
  engine's publisher (``add_source``);
* **bind** (llm-d's central mode): one SUB socket bound by the router; every engine
  connects and names itself in the topic ``kv@<ip>:<port>@<model>`` (``bind``). Streams
  are keyed by topic and DP rank. A message counts only if it comes from the address of
  the engine its topic names, and with CURVE keys only publishers holding an admitted
  key connect at all (:mod:`router.events.publishers`).

Each stream tracks its sequence number. After connecting (a SUB misses what was
published before its subscription took effect) and after a gap, it asks the engine's
replay socket for the missing batches over a DEALER, buffering live batches meanwhile.
If the replay cannot cover the gap (the engine keeps only its last batches), or the
sequence goes backwards (the engine restarted), the engine's entries are cleared and
rebuilt from the events that follow.

A restarted engine numbers its batches from 0 again, and the first ones may be lost
to the slow joiner before the SUB reconnects, so sequence numbers alone may never
reveal the restart. Each stream therefore remembers a digest of the last batch it
applied; when the SUB reconnects (ZMQ's socket monitor says so) or the engine is
re-admitted after an ejection, the stream *resyncs*: it replays from its last sequence
number and checks that the engine still holds that very batch. If it does, only newer
batches apply; if not, the engine restarted: clear, and rebuild from sequence 0.
A replay that goes unanswered is tried again after a backoff (1 s, doubling to 30 s)
while no live batch starts one first: an idle engine publishes nothing that would reveal
the gap, and its blocks would otherwise stay missing from the index until it does.
Garbage frames are counted and dropped; nothing here lets an exception end the
subscriber. Every socket has a ``MAXMSGSIZE`` (``events.max_message_bytes``): libzmq
disconnects a publisher whose frame would be larger before allocating it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import xxhash
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from router.config import MAX_EVENT_MESSAGE_BYTES
from router.events.ingest import EventIngestor, StreamState
from router.events.publishers import CurveGate, CurveKeys, host_addresses, same_address
from router.events.vllm import (
    END_SEQ,
    EventDecodeError,
    decode_batch,
    decode_seq,
    encode_seq,
    replay_reply,
)
from router.metric_catalogue import (
    KV_EVENT_BATCHES,
    KV_EVENT_GAPS,
    KV_EVENT_GARBAGE,
    KV_EVENT_LAG_SECONDS,
    KV_EVENT_PUBLISHERS_REFUSED,
    KV_EVENT_REPLAYS,
    KV_EVENT_RESTARTS,
    KV_EVENTS_ADDRESS_MISMATCH,
)
from router.types import EngineKey

if TYPE_CHECKING:
    from router.metric_catalogue import StateFamily

log = logging.getLogger("kvroute.events")

_PENDING_LIMIT = 100_000
RETRY_FIRST_S = 1.0
"""Delay before a replay that went unanswered is tried again; it doubles with each
failure in a row up to :data:`RETRY_MAX_S` and starts over after a replay succeeds."""
RETRY_MAX_S = 30.0
_RESOLVE_EVERY_S = 30.0
"""How long the resolved addresses of an engine named by a host name are trusted."""
MAX_TOPICS = 4_096
"""Bound on the (topic, rank) streams of a bound socket: publishers choose topics, and
messages on topics past it are dropped as unknown."""


@dataclass(slots=True)
class EventSource:
    """Where one engine stream's events come from."""

    engine: EngineKey
    namespace: str
    """The model the engine serves (seeds root block keys)."""
    endpoint: str | None = None
    """The engine's PUB endpoint to connect to (connect mode); None in bind mode."""
    replay_endpoint: str | None = None
    topic: str = ""
    block_size: int | None = None


@dataclass(slots=True)
class SubscriberStats:
    """Counters for metrics; ``lag`` holds each stream's last publish-to-apply delay."""

    batches: int = 0
    gaps: int = 0
    replays: Counter[str] = field(default_factory=Counter)
    """Replays by outcome: ok, uncovered (engine no longer had the range), failed."""
    restarts: int = 0
    garbage: int = 0
    unknown_topics: int = 0
    address_mismatches: int = 0
    """Bind mode: messages dropped because their topic names an engine at another
    address than the publisher's."""
    publishers_refused: int = 0
    """Bind mode with CURVE: publisher handshakes refused for an unknown key."""
    lag: dict[EngineKey, float] = field(default_factory=dict)

    def metric_families(self) -> Iterator[StateFamily]:
        """Batches, gaps, replays by outcome, restarts, frames dropped, handshakes
        refused, and each stream's lag."""
        yield KV_EVENT_BATCHES.value(self.batches)
        yield KV_EVENT_GAPS.value(self.gaps)
        outcomes = ("ok", "uncovered", "failed")
        yield KV_EVENT_REPLAYS.labelled(((o,), self.replays.get(o, 0)) for o in outcomes)
        yield KV_EVENT_RESTARTS.value(self.restarts)
        yield KV_EVENT_GARBAGE.value(self.garbage)
        yield KV_EVENTS_ADDRESS_MISMATCH.value(self.address_mismatches)
        yield KV_EVENT_PUBLISHERS_REFUSED.value(self.publishers_refused)
        yield KV_EVENT_LAG_SECONDS.labelled(
            ((engine.label,), seconds) for engine, seconds in sorted(self.lag.items())
        )


TopicResolver = Callable[[str, int | None], EventSource | None]
"""Maps (topic, batch DP rank) of a bind-mode message to its source, or None to drop it."""
PeerCheck = Callable[[str, int | None, str], Awaitable[bool]]
"""Whether a bind-mode message on (topic, rank) may come from this peer address."""


class _Stream:
    """Sequence tracking and replay for one engine stream."""

    def __init__(
        self, source: EventSource, subscriber: KVEventSubscriber, state: StreamState | None = None
    ) -> None:
        self.source = source
        self.state = state or StreamState(source.engine, source.namespace, source.block_size)
        self.sub = subscriber
        self.replaying = False
        self.pending: deque[tuple[int, bytes]] = deque()
        self.overflowed = False
        self.skip_through: int | None = None
        self.last_digest: int | None = None
        self.resync_wanted = False
        self.task: asyncio.Task[None] | None = None
        self.failed_replays = 0
        """Replays in a row that went unanswered (the retry's backoff)."""
        self.retry: asyncio.TimerHandle | None = None

    # -------------------------------------------------------------- live messages

    async def on_message(self, seq: int, payload: bytes) -> None:
        if self.replaying:
            if len(self.pending) >= _PENDING_LIMIT:
                self.overflowed = True
                self.pending.clear()
            self.pending.append((seq, payload))
            return
        if self.skip_through is not None:
            if seq <= self.skip_through:
                return  # already applied through the replay that just finished
            self.skip_through = None
        last = self.state.last_seq
        if last is None:
            if seq > 0 and self.source.replay_endpoint:
                self._start_replay(0, seq, payload)
                return
        elif seq <= last:
            await self._restarted(f"sequence went back from {last} to {seq}")
            if seq > 0 and self.source.replay_endpoint:
                self._start_replay(0, seq, payload)
                return
        elif seq > last + 1:
            self.sub.stats.gaps += 1
            if self.source.replay_endpoint:
                self._start_replay(last + 1, seq, payload)
                return
            log.warning(
                "%s: missed batches %d..%d and no replay endpoint; rebuilding",
                self.state.engine.label,
                last + 1,
                seq - 1,
            )
            await self.sub.ingestor.clear(self.state)
        await self.apply(seq, payload)

    async def apply(self, seq: int, payload: bytes) -> None:
        self.state.last_seq = seq
        self.last_digest = xxhash.xxh3_64_intdigest(payload)
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            self.sub.stats.garbage += 1
            log.debug("%s: dropped undecodable batch %d: %s", self.state.engine.label, seq, exc)
            return
        await self.sub.ingestor.apply(self.state, batch)
        self.sub.stats.batches += 1
        self.sub.stats.lag[self.state.engine] = max(time.time() - batch.ts, 0.0)

    # -------------------------------------------------------------- replay

    def request_replay(self, start: int) -> None:
        """Ask for everything from ``start`` (used right after connecting)."""
        if self.source.replay_endpoint and not self.replaying:
            self._start_replay(start, None, None)

    def resync(self) -> None:
        """Check the engine is the one whose batches we applied, and catch up."""
        if not self.source.replay_endpoint:
            return
        if self.replaying:
            self.resync_wanted = True
            return
        last = self.state.last_seq
        self._start_replay(0 if last is None else last, None, None, verify=last is not None)

    def _start_replay(
        self, start: int, seq: int | None, payload: bytes | None, verify: bool = False
    ) -> None:
        self.cancel_retry()
        self.replaying = True
        self.overflowed = False
        self.pending.clear()
        if seq is not None and payload is not None:
            self.pending.append((seq, payload))
        self.task = asyncio.ensure_future(self._replay(start, verify))

    def cancel_retry(self) -> None:
        if self.retry is not None:
            self.retry.cancel()
            self.retry = None

    def _schedule_retry(self) -> None:
        """After an unanswered replay with no live batch waiting: try again later (a live
        batch that arrives first starts a replay of its own, which cancels this one)."""
        self.cancel_retry()
        delay = min(RETRY_FIRST_S * 2 ** (self.failed_replays - 1), RETRY_MAX_S)
        self.retry = asyncio.get_running_loop().call_later(delay, self._retry_replay)

    def _retry_replay(self) -> None:
        self.retry = None
        if self.replaying:
            return
        if self.state.last_seq is None:
            self.request_replay(0)
        else:
            self.resync()  # from the last batch applied, checking it is still the engine's

    async def _restarted(self, why: str) -> None:
        self.sub.stats.restarts += 1
        log.warning("%s: %s; engine restarted, rebuilding", self.state.engine.label, why)
        await self.sub.ingestor.clear(self.state)
        self.state.last_seq = None
        self.last_digest = None

    async def _replay(self, start: int, verify: bool = False) -> None:
        try:
            while True:
                if await self._fetch_and_apply(start, verify):
                    start, verify = 0, False  # the engine restarted: rebuild from its start
                    continue
                verify = False
                if self.overflowed:
                    log.warning(
                        "%s: live buffer overflowed during replay; rebuilding",
                        self.state.engine.label,
                    )
                    await self.sub.ingestor.clear(self.state)
                    self.state.last_seq = None
                    self.overflowed = False
                restart = None
                # Batches keep arriving while we drain; stay in replay mode until none wait.
                while self.pending and restart is None:
                    pending = sorted(self.pending)
                    self.pending.clear()
                    restart = await self._drain(pending)
                if restart is None:
                    if not self.resync_wanted:
                        if self.failed_replays:
                            self._schedule_retry()
                        break
                    self.resync_wanted = False
                    last = self.state.last_seq
                    restart, verify = (0, False) if last is None else (last, True)
                start = restart
        except asyncio.CancelledError:
            raise
        except Exception:  # the subscriber must survive anything a peer sends
            log.exception("%s: replay failed", self.state.engine.label)
        finally:
            self.replaying = False
            self.skip_through = self.state.last_seq

    async def _drain(self, pending: list[tuple[int, bytes]]) -> int | None:
        """Apply buffered live batches in order; return where a new gap starts, if any."""
        for seq, payload in pending:
            last = self.state.last_seq
            if last is not None and seq <= last:
                continue
            if last is not None and seq > last + 1:
                self.sub.stats.gaps += 1
                rest = [(s, p) for s, p in pending if s >= seq]
                self.pending.extend(rest)
                return last + 1
            await self.apply(seq, payload)
        return None

    async def _fetch_and_apply(self, start: int, verify: bool = False) -> bool:
        """Replay from ``start`` and apply what is new; True if verification showed the
        engine restarted (its batch ``start`` is gone or differs from the one applied)."""
        endpoint = self.source.replay_endpoint
        assert endpoint is not None
        sock = self.sub.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.sub.max_message_bytes)
        try:
            sock.connect(endpoint)
            await sock.send_multipart([b"", encode_seq(start)])
            first = True
            timeout_ms = int(self.sub.replay_timeout * 1000)
            while True:
                if not await sock.poll(timeout_ms, zmq.POLLIN):
                    self.sub.stats.replays["failed"] += 1
                    self.failed_replays += 1
                    log.warning("%s: replay from %d timed out", self.state.engine.label, start)
                    last = self.state.last_seq
                    if last is not None and self.pending:
                        if self.pending[0][0] <= last:
                            # Live batches numbered from the start again: a restart.
                            await self._restarted(
                                f"sequence went back from {last} to {self.pending[0][0]}"
                            )
                        else:
                            # The gap stays unexplained: start over from live events.
                            await self.sub.ingestor.clear(self.state)
                            self.state.last_seq = None
                    return False
                frames = await sock.recv_multipart()
                reply = replay_reply(frames)
                if reply is None:
                    self.sub.stats.garbage += 1
                    continue
                seq_frame, payload = reply
                if seq_frame == END_SEQ:
                    self.sub.stats.replays["ok"] += 1
                    self.failed_replays = 0
                    if verify and first:
                        await self._restarted(f"it no longer holds batch {start}")
                        return True
                    return False
                try:
                    seq = decode_seq(seq_frame)
                except EventDecodeError:
                    self.sub.stats.garbage += 1
                    continue
                if first:
                    first = False
                    if verify and seq == start:
                        if xxhash.xxh3_64_intdigest(payload) != self.last_digest:
                            await self._restarted(f"its batch {seq} is not the one applied")
                            return True
                        continue
                    if seq > start:
                        self.sub.stats.replays["uncovered"] += 1
                        log.warning(
                            "%s: replay starts at %d, not %d; rebuilding",
                            self.state.engine.label,
                            seq,
                            start,
                        )
                        await self.sub.ingestor.clear(self.state)
                        self.state.last_seq = None
                last = self.state.last_seq
                if last is not None and seq <= last:
                    continue
                await self.apply(seq, payload)
        finally:
            sock.close(0)
        return False


class KVEventSubscriber:
    """Owns the SUB sockets and the per-stream state machines."""

    def __init__(
        self,
        ingestor: EventIngestor,
        *,
        ctx: zmq.asyncio.Context | None = None,
        replay_timeout: float = 2.0,
        receive_hwm: int = 100_000,
        max_message_bytes: int = MAX_EVENT_MESSAGE_BYTES,
    ) -> None:
        self.ingestor = ingestor
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.replay_timeout = replay_timeout
        self.receive_hwm = receive_hwm
        self.max_message_bytes = max_message_bytes
        """ZMQ ``MAXMSGSIZE`` of every socket: libzmq disconnects a peer whose frame header
        announces more, before allocating it."""
        self.stats = SubscriberStats()
        self._streams: dict[EngineKey, _Stream] = {}
        self._readers: dict[EngineKey, tuple[zmq.asyncio.Socket, list[asyncio.Task[None]]]] = {}
        self._bind: tuple[zmq.asyncio.Socket, asyncio.Task[None]] | None = None
        self._topic_streams: dict[tuple[str, int | None], _Stream] = {}
        self.bound_endpoint: str | None = None
        self._curve: tuple[zmq.asyncio.Context, CurveGate] | None = None
        self._addresses: dict[str, tuple[frozenset[str], float]] = {}
        """Bind mode: the addresses of each engine endpoint topics have named, and until
        when they hold (a host name is resolved again after ``_RESOLVE_EVERY_S``)."""
        self._mismatch_warned: set[str] = set()

    def _socket(self, ctx: zmq.asyncio.Context | None = None) -> zmq.asyncio.Socket:
        sock = (ctx or self.ctx).socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.receive_hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        return sock

    def stream_state(self, engine: EngineKey) -> StreamState | None:
        stream = self._streams.get(engine)
        return stream.state if stream else None

    def states(self) -> list[StreamState]:
        """The state of every stream followed (connect and bind mode)."""
        streams = {id(s): s for s in (*self._streams.values(), *self._topic_streams.values())}
        return [s.state for s in streams.values()]

    # -------------------------------------------------------------- connect mode

    async def add_source(
        self, source: EventSource, state: StreamState | None = None, digest: int | None = None
    ) -> None:
        """Connect to an engine's publisher and start following its stream.

        ``state`` resumes a stream another writer left (the standalone indexer after a
        takeover, a replica's snapshot): replay starts after its ``last_seq`` and its hash
        maps are kept. With ``digest``, the digest of the batch ``last_seq`` that state
        applied (:meth:`digest_of`), the replay first checks the engine still holds that
        very batch, and rebuilds if it restarted since.
        """
        if source.endpoint is None:
            raise ValueError("connect mode needs the engine's PUB endpoint")
        await self.remove_source(source.engine)
        stream = _Stream(source, self, state)
        sock = self._socket()
        sock.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        # Watch before connecting, or the first connection's event may be missed and a
        # reconnect mistaken for it.
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
        sock.connect(source.endpoint)
        self._streams[source.engine] = stream
        tasks = [
            asyncio.ensure_future(self._read(sock, lambda topic, rank: stream)),
            asyncio.ensure_future(self._watch_reconnects(monitor, stream)),
        ]
        self._readers[source.engine] = (sock, tasks)
        last = stream.state.last_seq
        if last is not None and digest is not None:
            stream.last_digest = digest
            stream.resync()
        else:
            stream.request_replay(0 if last is None else last + 1)

    async def remove_source(self, engine: EngineKey, clear: bool = False) -> None:
        """Stop following an engine; with ``clear``, drop its index entries too."""
        reader = self._readers.pop(engine, None)
        stream = self._streams.pop(engine, None)
        if reader is not None:
            sock, tasks = reader
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            sock.disable_monitor()
            sock.close(0)
        if stream is not None:
            stream.cancel_retry()
            if stream.task is not None:
                stream.task.cancel()
                await asyncio.gather(stream.task, return_exceptions=True)
            if clear:
                await self.ingestor.clear(stream.state)
        for key, s in list(self._topic_streams.items()):
            if s.state.engine == engine:
                s.cancel_retry()
                del self._topic_streams[key]

    async def wait_synced(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until no stream is catching up by replay.

        A router that starts routing before its initial replays finished could record a
        decision that an old event in the replay (an ``AllBlocksCleared``) then erases.
        """
        deadline = asyncio.get_running_loop().time() + timeout
        while any(s.replaying for s in self._streams.values()):
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    def digest_of(self, engine: EngineKey) -> int | None:
        """Digest of the last batch applied from an engine's stream (None: none yet)."""
        stream = self._streams.get(engine)
        return None if stream is None else stream.last_digest

    def resync(self, engine: EngineKey) -> None:
        """Verify an engine's stream against its replay buffer (after a possible restart)."""
        stream = self._streams.get(engine)
        if stream is not None:
            stream.resync()

    async def _watch_reconnects(self, monitor: zmq.asyncio.Socket, stream: _Stream) -> None:
        """Resync a stream each time its SUB socket reconnects (not on the first connect)."""
        monitor.setsockopt(zmq.LINGER, 0)
        connects = 0
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_CONNECTED:
                    connects += 1
                    if connects > 1:
                        stream.resync()
        finally:
            monitor.close(0)

    # -------------------------------------------------------------- bind mode

    async def bind(
        self,
        endpoint: str,
        resolver: TopicResolver,
        *,
        check_address: bool = True,
        curve: CurveKeys | None = None,
    ) -> str:
        """Bind one SUB socket that engines connect to; returns the bound endpoint.

        ``check_address`` (TCP only): drop a message unless it comes from the address of
        the engine its topic names. ``curve``: admit only publishers holding one of its
        keys (the socket gets a context of its own, whose ZAP handler checks them)."""
        if self._bind is not None:
            raise RuntimeError("the subscriber is already bound")
        ctx = None
        if curve is not None:
            ctx = zmq.asyncio.Context()
            gate = CurveGate(curve, ctx, self._publisher_refused)
            gate.start()
            self._curve = (ctx, gate)
        sock = self._socket(ctx)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        if self._curve is not None:
            self._curve[1].secure(sock)
        sock.bind(endpoint)
        self.bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)

        async def from_engine(topic: str, rank: int | None, peer: str) -> bool:
            source = resolver(topic, rank)
            if source is None:
                return True  # an unknown topic: dropped and counted as one
            return await self._from_engine(source.engine.endpoint, topic, peer)

        peers = from_engine if check_address and endpoint.startswith("tcp://") else None

        def route(topic: str, rank: int | None) -> _Stream | None:
            stream = self._topic_streams.get((topic, rank))
            if stream is None:
                if len(self._topic_streams) >= MAX_TOPICS:  # topics are the peer's to choose
                    return None
                source = resolver(topic, rank)
                if source is None:
                    return None
                stream = _Stream(source, self)
                self._topic_streams[(topic, rank)] = stream
                self._streams[source.engine] = stream
            return stream

        self._bind = (sock, asyncio.ensure_future(self._read(sock, route, True, peers)))
        return self.bound_endpoint

    def _publisher_refused(self) -> None:
        self.stats.publishers_refused += 1

    async def _from_engine(self, endpoint: str, topic: str, peer: str) -> bool:
        """Whether ``peer`` is the address of the engine at ``endpoint`` (a host name is
        resolved at most every ``_RESOLVE_EVERY_S``, not per message); a mismatch is
        counted and warned about once per engine."""
        now = time.monotonic()
        known = self._addresses.get(endpoint)
        if known is None or now >= known[1]:
            addresses, literal = await host_addresses(endpoint)
            known = self._addresses[endpoint] = (
                addresses,
                float("inf") if literal else now + _RESOLVE_EVERY_S,
            )
        if same_address(peer, known[0]):
            return True
        self.stats.address_mismatches += 1
        if endpoint not in self._mismatch_warned:
            self._mismatch_warned.add(endpoint)
            log.warning(
                "KV events on topic %r came from %s, not from engine %s: dropped (every "
                "such message is counted in kvroute_kv_events_address_mismatch_total)",
                topic[:200],
                peer,
                endpoint,
            )
        return False

    # -------------------------------------------------------------- reading

    async def _read(
        self,
        sock: zmq.asyncio.Socket,
        route: Callable[[str, int | None], _Stream | None],
        by_topic: bool = False,
        peers: PeerCheck | None = None,
    ) -> None:
        while True:
            peer = None
            try:
                if peers is None:
                    frames = await sock.recv_multipart()
                else:  # the peer's address is a property of the received frames
                    message = await sock.recv_multipart(copy=False)
                    peer = message[0].get("Peer-Address")
                    frames = [part.bytes for part in message]
                    del message
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                if exc.errno == zmq.ETERM:
                    return
                log.warning("KV-event socket error: %s", exc)
                continue
            await self._dispatch(frames, route, by_topic, peers, peer)
            # Not kept alive while waiting for the next message (a large frame would be).
            del frames

    async def _dispatch(
        self,
        frames: list[bytes],
        route: Callable[[str, int | None], _Stream | None],
        by_topic: bool,
        peers: PeerCheck | None = None,
        peer: str | None = None,
    ) -> None:
        """Hand one message to its stream; garbage is counted, nothing raises."""
        try:
            if len(frames) != 3:
                self.stats.garbage += 1
                return
            topic_raw, seq_raw, payload = frames
            seq = decode_seq(seq_raw)
            rank = None
            if by_topic:
                rank = _peek_rank(payload)
            topic = topic_raw.decode("utf-8", "replace")
            # Before the stream exists: a foreign publisher creates none.
            if peers is not None and not await peers(topic, rank, peer or ""):
                return
            stream = route(topic, rank)
            if stream is None:
                self.stats.unknown_topics += 1
                return
            await stream.on_message(seq, payload)
        except EventDecodeError:
            self.stats.garbage += 1
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("KV-event message dropped")

    async def close(self) -> None:
        for engine in list(self._readers):
            await self.remove_source(engine)
        for stream in [*self._streams.values(), *self._topic_streams.values()]:
            stream.cancel_retry()
            if stream.task is not None:
                stream.task.cancel()
                await asyncio.gather(stream.task, return_exceptions=True)
        if self._bind is not None:
            sock, task = self._bind
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            sock.close(0)
            self._bind = None
        if self._curve is not None:
            ctx, gate = self._curve
            gate.stop()
            ctx.destroy(linger=0)
            self._curve = None
        self._streams.clear()
        self._topic_streams.clear()


def _peek_rank(payload: bytes) -> int | None:
    """The batch's DP rank, or None if the payload cannot be decoded (counted later)."""
    try:
        return decode_batch(payload).data_parallel_rank
    except EventDecodeError:
        return None


def parse_llmd_topic(topic: str) -> tuple[str, str] | None:
    """``kv@<ip>:<port>@<model>`` -> (``ip:port``, model), or None for other topics."""
    parts = topic.split("@", 2)
    if len(parts) != 3 or parts[0] != "kv" or not parts[1] or not parts[2]:
        return None
    return parts[1], parts[2]
