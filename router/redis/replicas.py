"""What a router replica shares through Redis besides the index, started and stopped in
its order: the exchange of in-flight load (``index.redis.share_load``), and in the
replicated mode the engine streams' snapshots it starts from and writes, and its
catch-up on the peers' decisions.

Start runs in two steps around the engines' subscription: :meth:`ReplicaSharing.start`
before it (the incarnation, the load exchange, the snapshots to warm-start the streams
from), :meth:`ReplicaSharing.catch_up` after it (the decision stream, the snapshot
writer).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from router.availability import IndexUnavailable

if TYPE_CHECKING:
    from router.events.follow import EventFollowing
    from router.events.snapshots import SnapshotWriter
    from router.fleet.load import LoadTracker
    from router.fleet.shared_load import SharedLoad
    from router.index.replicated import ReplicatedIndex
    from router.live_config import LiveConfig
    from router.metrics import StateSources
    from router.redis.client import RedisClient
    from router.types import EngineKey

log = logging.getLogger("kvroute")


class ReplicaSharing:
    """The load exchange and the replicated mode's snapshots and catch-up of one
    replica."""

    def __init__(
        self,
        live: LiveConfig,
        redis: RedisClient,
        loads: LoadTracker,
        known: Callable[[EngineKey], bool],
        replicated: ReplicatedIndex | None,
        events: EventFollowing,
        sources: StateSources,
    ) -> None:
        """``known`` says whether an engine is of this fleet; ``sources`` are the
        metrics' (they export the exchange and the writer)."""
        self.live = live
        self.redis = redis
        self.loads = loads
        self.known = known
        self.replicated = replicated
        self.events = events
        self.sources = sources
        self.shared_load: SharedLoad | None = None
        """The exchange of in-flight load with the other replicas."""
        self.snapshots: SnapshotWriter | None = None
        """The replicated mode's writer of engine stream snapshots."""

    async def start(self) -> None:
        """Before the engines are subscribed."""
        from router.fleet.shared_load import SharedLoad

        redis = self.redis
        # Learn Redis's incarnation now, so that after an outage the router can tell a
        # Redis that kept its data from one that restarted empty.
        with contextlib.suppress(IndexUnavailable):
            await redis.check_incarnation(timeout=max(redis.budget, 1.0))
        config = self.live.current
        cfg = config.index.redis
        if cfg.share_load:
            replicated = self.replicated
            self.shared_load = SharedLoad(
                redis,
                self.loads,
                self.known,
                replica=replicated.replica if replicated is not None else None,
                interval=cfg.load_interval_s,
                ttl=cfg.load_ttl_s,
            )
            self.shared_load.start()
            self.sources.shared_load = self.shared_load
        if self.replicated is not None:
            await self._load_snapshots()

    async def _load_snapshots(self) -> None:
        """Replicated mode, before any engine is subscribed: the engine streams'
        snapshots, taken as each engine is subscribed during start."""
        from router.events.snapshots import load_snapshots

        config = self.live.current
        if not self.events.subscribes or config.index.replicated.snapshot_interval_s <= 0:
            return
        try:
            self.events.warm = await load_snapshots(self.redis)
        except Exception as exc:  # no snapshot is no reason not to start: start cold
            log.warning("replicated index: no engine snapshots to start from (%s)", exc)
        else:
            log.info("replicated index: %d engine snapshot(s) to start from", len(self.events.warm))

    async def catch_up(self) -> None:
        """Replicated mode, once the engines are subscribed (and known, for peers'
        decisions about them): read the peers' decisions still live, then follow the
        decision stream and write snapshots in the background. Snapshots not taken by
        now are dropped: a later engine starts from its own events, not from a snapshot
        of unknown age."""
        from router.events.snapshots import SnapshotWriter

        index = self.replicated
        if index is None:
            return
        self.events.warm.clear()
        await index.sync.start(catch_up_timeout=max(self.redis.admin_timeout, 1.0))
        cfg = self.live.current.index.replicated
        if self.events.subscribes and cfg.snapshot_interval_s > 0:
            self.snapshots = SnapshotWriter(
                self.redis, index.replica, cfg.snapshot_interval_s, self.events.stream_states
            )
            self.snapshots.start()
            self.sources.snapshots = self.snapshots

    async def stop_snapshots(self) -> None:
        """First at stop, while every stream is still followed: a writer stopped later
        would see none."""
        if self.snapshots is not None:
            await self.snapshots.stop()

    async def stop_load_exchange(self, before: Callable[[SharedLoad], None]) -> None:
        """Withdraw this replica's load; ``before`` detaches what pushes changes of it."""
        if self.shared_load is not None:
            before(self.shared_load)
            await self.shared_load.stop()
