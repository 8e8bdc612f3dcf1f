"""Load shared between router replicas through Redis.

A router knows its own in-flight work per engine exactly, and nothing of its peers'
unless they share it. Every ``interval`` seconds, a background task of each replica
publishes its own in-flight work per engine (requests, queued prefill tokens, decode
tokens and blocks) under the index namespace with a ``ttl``, and reads back the other
replicas' entries in the same script call (``router/redis/load_exchange.py``); the sums
per engine become the ``peer_*`` part of the load view's totals
(:meth:`LoadTracker.set_peers`). Policies read the totals: no decision waits for Redis
or merges anything.

A replica that stops withdraws its entry; one that dies is forgotten once its entry
expires. While Redis is unavailable, peers' figures are kept for one ``ttl`` (they are
that fresh at worst), then dropped: each replica routes on its own load until Redis
returns. Peers' entries are at most ``interval`` plus one round trip old.

Between exchanges, changes travel at once (``index.redis.load_push``): the tracker
names each engine whose own work changed (a request sent, its first token, its end),
and the decision stream's publisher (:class:`~router.index.replicated.DecisionSync`)
carries this replica's work on those engines in its next entry (:meth:`take_changes`);
peers apply it from the stream (:meth:`apply_changes`). So a turn that follows its
previous one at once through another replica no longer finds that one still counted on
its engine for up to ``interval``. Every figure a replica sends carries a version (its
wall clock in ns, strictly increasing), and a peer keeps, per engine, the newer of what
the exchange read and what the stream brought, whichever arrives first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from router.fleet.load import NO_PEERS, InFlight, LoadTracker
from router.index.base import IndexUnavailable
from router.metric_catalogue import LOAD_CHANGES_APPLIED, LOAD_CHANGES_SENT, LOAD_PEERS
from router.redis.client import RedisClient, replica_id
from router.redis.load_exchange import LoadExchange
from router.types import EngineKey

if TYPE_CHECKING:
    from router.metric_catalogue import StateFamily

log = logging.getLogger("kvroute.load")

_Entry = tuple[str, int, int, int, int, int]
"""(endpoint, rank, requests, prefill tokens, decode tokens, decode blocks)."""
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(list[_Entry]).decode


def encode_load(work: Mapping[EngineKey, InFlight], version: int = 0) -> bytes:
    """One replica's in-flight work per engine, as published; a ``version`` rides as an
    entry with an empty endpoint (rank = the version), which replicas that know no
    versions skip as an engine outside their fleet."""
    entries = [(e.endpoint, e.rank, *w) for e, w in work.items()]
    if version:
        entries.append(("", version, 0, 0, 0, 0))
    return _encode(entries)


def decode_versioned(payload: bytes) -> tuple[int, dict[EngineKey, InFlight]]:
    """The inverse of :func:`encode_load`: (version (0: none), work per engine)."""
    version = 0
    work: dict[EngineKey, InFlight] = {}
    for ep, rank, *figures in _decode(payload):
        if ep:
            work[EngineKey(ep, rank)] = InFlight(*figures)
        else:
            version = rank
    return version, work


def decode_load(payload: bytes) -> dict[EngineKey, InFlight]:
    """The work per engine of :func:`encode_load`'s payload (its version left out)."""
    return decode_versioned(payload)[1]


@dataclass(slots=True)
class _Peer:
    """What this replica knows of one peer's work: per engine, the figures and the
    version they carry (from the last exchange, or newer from the stream)."""

    read: int = 0
    """The version of the last exchange's entry (0: none yet)."""
    work: dict[EngineKey, tuple[int, InFlight]] = field(default_factory=dict)


class SharedLoad:
    """Publishes this replica's in-flight work and folds its peers' into the tracker.

    ``known`` says whether an engine is in this router's fleet: peers may route to
    engines this replica does not serve, and those are ignored.
    """

    def __init__(
        self,
        redis: RedisClient,
        tracker: LoadTracker,
        known: Callable[[EngineKey], bool],
        *,
        replica: str | None = None,
        interval: float = 0.1,
        ttl: float = 1.0,
    ) -> None:
        self.redis = redis
        self._exchange = LoadExchange(redis)
        self.tracker = tracker
        self.known = known
        self.replica = replica or replica_id()
        self.interval = interval
        self.ttl = ttl
        self.peers = 0
        """Replicas whose load the last exchange returned."""
        self.exchanges = 0
        """Successful exchanges (for tests and logs)."""
        self.pushed = 0
        """Engines' figures this replica sent on the stream (:meth:`take_changes`)."""
        self.applied = 0
        """Peers' figures from the stream that were newer than what this replica had."""
        self.on_change: Callable[[], None] | None = None
        """Called when own work changed and :meth:`take_changes` has something (the
        stream publisher's wake-up); None: changes wait for the exchange."""
        self._last_ok: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._version = 0
        self._dirty: set[EngineKey] = set()
        self._peers: dict[str, _Peer] = {}

    def start(self) -> None:
        """Exchange every ``interval`` in the background until :meth:`stop`."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Stop exchanging and withdraw this replica's entry (peers stop counting it)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        with contextlib.suppress(IndexUnavailable):
            await self._exchange.share(self.replica, None, self._ttl_ms(), self._timeout())

    def _ttl_ms(self) -> int:
        return max(int(self.ttl * 1000), 1)

    def _timeout(self) -> float:
        # Off the request path: as slow as one interval is still useful, and anything
        # slower means Redis is in trouble (the client notices and probes it).
        return max(self.interval, self.redis.budget)

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.exchange()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bad peer entry must not end the exchange
                log.exception("exchanging load with peer replicas failed")
            await asyncio.sleep(max(self.interval - (time.monotonic() - started), 0.0))

    def _next_version(self) -> int:
        self._version = max(time.time_ns(), self._version + 1)
        return self._version

    async def exchange(self) -> None:
        """Publish own work, read peers', and update the tracker (one round trip)."""
        now = time.monotonic()
        try:
            payloads = await self._exchange.share(
                self.replica,
                encode_load(self.tracker.own(), self._next_version()),
                self._ttl_ms(),
                self._timeout(),
            )
        except IndexUnavailable:
            if self._peers and (self._last_ok is None or now - self._last_ok > self.ttl):
                # Peers' figures are older than they would be allowed to live in Redis
                # (or came from the stream alone, which cannot say that a peer died).
                self._last_ok = None
                self.peers = 0
                self._peers.clear()
                self.tracker.set_peers({})
                self.tracker.set_replicas(1)
            return
        peers: dict[str, _Peer] = {}
        for replica, payload in payloads.items():
            version, work = decode_versioned(payload)
            peer = peers[replica] = _Peer()
            peer.read = version
            peer.work = {e: (version, w) for e, w in work.items() if self.known(e)}
            before = self._peers.get(replica)
            if before is not None:  # what the stream brought since that entry was written
                for engine, seen in before.work.items():
                    if seen[0] > version:
                        peer.work[engine] = seen
        self._peers = peers
        totals: dict[EngineKey, InFlight] = {}
        for peer in peers.values():
            for engine, (_, work) in peer.work.items():
                seen = totals.get(engine)
                if seen is not None:
                    work = seen.plus(work)
                if any(work):
                    totals[engine] = work
        self.tracker.set_peers(totals)
        self.peers = len(payloads)
        self.tracker.set_replicas(1 + self.peers)
        self.exchanges += 1
        self._last_ok = now
        if self.peers and self._dirty and self.on_change is not None:
            self.on_change()  # changes held while no peer was there to read them

    # ------------------------------------------------------------------ changes on the stream

    def changed(self, engine: EngineKey) -> None:
        """Own work on ``engine`` changed (the tracker's ``on_change``)."""
        dirty = self._dirty
        if engine not in dirty:
            dirty.add(engine)
            if self.peers and self.on_change is not None:
                self.on_change()

    @property
    def has_changes(self) -> bool:
        """Changes to send, and peers to read them (the last exchange found some)."""
        return bool(self._dirty) and self.peers > 0

    def take_changes(self) -> tuple[bytes, set[EngineKey]] | None:
        """This replica's work now on the engines whose work changed since the last
        call (with a new version), for the stream, and those engines (to :meth:`restore`
        if it could not be sent, else to :meth:`sent`); None when nothing changed."""
        dirty = self._dirty
        if not dirty:
            return None
        self._dirty = set()
        view = self.tracker.view
        work = {}
        for engine in dirty:
            load = view.get(engine)
            work[engine] = load.own() if load is not None else NO_PEERS
        return encode_load(work, self._next_version()), dirty

    def sent(self, engines: set[EngineKey]) -> None:
        """Changes :meth:`take_changes` gave reached the stream."""
        self.pushed += len(engines)

    def restore(self, engines: set[EngineKey]) -> None:
        """Changes :meth:`take_changes` gave that did not reach Redis: send them later."""
        self._dirty |= engines

    def apply_changes(self, replica: str, payload: bytes) -> None:
        """A peer's figures from the stream: each engine's replaces what this replica
        has when newer. Figures older than ``ttl`` (a stream replayed at start), and any
        while the exchange has not succeeded within ``ttl`` (only it can tell that a peer
        died), are left to the exchange. Raises ``msgspec.DecodeError`` on a malformed
        payload."""
        if replica == self.replica:
            return
        if self._last_ok is None or time.monotonic() - self._last_ok > self.ttl:
            return
        version, work = decode_versioned(payload)
        if not version or time.time_ns() - version > self.ttl * 1e9:
            return
        peer = self._peers.get(replica)
        if peer is None:
            peer = self._peers[replica] = _Peer()
        if version <= peer.read:
            return
        touched = []
        for engine, figures in work.items():
            seen = peer.work.get(engine)
            if (seen is not None and seen[0] >= version) or not self.known(engine):
                continue
            peer.work[engine] = (version, figures)
            touched.append(engine)
        for engine in touched:
            total = NO_PEERS
            for other in self._peers.values():
                seen = other.work.get(engine)
                if seen is not None:
                    total = total.plus(seen[1])
            self.tracker.set_peer(engine, total)
        self.applied += len(touched)

    def metric_families(self) -> Iterator[StateFamily]:
        """Peers counted, and the in-flight changes sent to them and applied from them."""
        yield LOAD_PEERS.value(self.peers)
        yield LOAD_CHANGES_SENT.value(self.pushed)
        yield LOAD_CHANGES_APPLIED.value(self.applied)
