"""Load shared between router replicas through Redis.

A router knows its own in-flight work per engine exactly, and nothing of its peers'
unless they share it. Every ``interval`` seconds, a background task of each replica
publishes its own in-flight work per engine (requests, queued prefill tokens, decode
tokens and blocks) under the index namespace with a ``ttl``, and reads back the other
replicas' entries in the same script call; the sums per engine become the ``peer_*``
part of the load view's totals (:meth:`LoadTracker.set_peers`). Policies read the
totals: no decision waits for Redis or merges anything.

A replica that stops withdraws its entry; one that dies is forgotten once its entry
expires. While Redis is unavailable, peers' figures are kept for one ``ttl`` (they are
that fresh at worst), then dropped: each replica routes on its own load until Redis
returns. Peers' entries are at most ``interval`` plus one round trip old.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

import msgspec

from router.engines.load import InFlight, LoadTracker
from router.index.base import IndexUnavailable
from router.index.redis import RedisIndex, replica_id
from router.types import EngineKey

log = logging.getLogger("kvroute.load")

_Entry = tuple[str, int, int, int, int, int]
"""(endpoint, rank, requests, prefill tokens, decode tokens, decode blocks)."""
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(list[_Entry]).decode


def encode_load(work: Mapping[EngineKey, InFlight]) -> bytes:
    """One replica's in-flight work per engine, as published."""
    return _encode([(e.endpoint, e.rank, *w) for e, w in work.items()])


def decode_load(payload: bytes) -> dict[EngineKey, InFlight]:
    """The inverse of :func:`encode_load`."""
    return {EngineKey(ep, rank): InFlight(*work) for ep, rank, *work in _decode(payload)}


class SharedLoad:
    """Publishes this replica's in-flight work and folds its peers' into the tracker.

    ``known`` says whether an engine is in this router's fleet: peers may route to
    engines this replica does not serve, and those are ignored.
    """

    def __init__(
        self,
        index: RedisIndex,
        tracker: LoadTracker,
        known: Callable[[EngineKey], bool],
        *,
        replica: str | None = None,
        interval: float = 0.1,
        ttl: float = 1.0,
    ) -> None:
        self.index = index
        self.tracker = tracker
        self.known = known
        self.replica = replica or replica_id()
        self.interval = interval
        self.ttl = ttl
        self.peers = 0
        """Replicas whose load the last exchange returned."""
        self.exchanges = 0
        """Successful exchanges (for tests and logs)."""
        self._last_ok: float | None = None
        self._task: asyncio.Task[None] | None = None

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
            await self.index.share_load(self.replica, None, self._ttl_ms(), self._timeout())

    def _ttl_ms(self) -> int:
        return max(int(self.ttl * 1000), 1)

    def _timeout(self) -> float:
        # Off the request path: as slow as one interval is still useful, and anything
        # slower means Redis is in trouble (the index notices and probes it).
        return max(self.interval, self.index.budget)

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

    async def exchange(self) -> None:
        """Publish own work, read peers', and update the tracker (one round trip)."""
        now = time.monotonic()
        try:
            payloads = await self.index.share_load(
                self.replica, encode_load(self.tracker.own()), self._ttl_ms(), self._timeout()
            )
        except IndexUnavailable:
            if self._last_ok is not None and now - self._last_ok > self.ttl:
                # Peers' figures are older than they would be allowed to live in Redis.
                self._last_ok = None
                self.peers = 0
                self.tracker.set_peers({})
            return
        totals: dict[EngineKey, InFlight] = {}
        for payload in payloads.values():
            for engine, work in decode_load(payload).items():
                if not self.known(engine):
                    continue
                seen = totals.get(engine)
                if seen is not None:
                    work = InFlight(*(a + b for a, b in zip(seen, work, strict=True)))
                totals[engine] = work
        self.tracker.set_peers(totals)
        self.peers = len(payloads)
        self.exchanges += 1
        self._last_ok = now
