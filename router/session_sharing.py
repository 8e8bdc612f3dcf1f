"""What router replicas tell each other at once: session pins and load changes.

With Redis (either mode) the decision stream carries them. With a policy that keeps
sessions (``latency``) its session pins go to the other replicas and theirs come back,
so a conversation's next turn finds its engine whichever replica it reaches; with
``index.redis.load_push``, changes of in-flight load go and come back too. The
replicated mode's decision stream carries both itself; in the shared index's mode a
follower of the stream of its own (:attr:`SessionSharing.sync`) lives while either
needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from router.sessions import SessionMap

if TYPE_CHECKING:
    from router.config import Config
    from router.core import RoutingCore
    from router.fleet.load import LoadTracker
    from router.fleet.shared_load import SharedLoad
    from router.index.replicated import DecisionSync, ReplicatedIndex
    from router.live_config import LiveConfig
    from router.metrics import StateSources
    from router.redis.client import RedisClient
    from router.types import EngineKey


class SessionSharing:
    """Connects the policy's session map and the load exchange to the decision stream."""

    def __init__(
        self,
        live: LiveConfig,
        core: RoutingCore,
        loads: LoadTracker,
        redis: RedisClient | None,
        replicated: ReplicatedIndex | None,
        shared_load: Callable[[], SharedLoad | None],
        known: Callable[[EngineKey], bool],
        sources: StateSources,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        """``shared_load`` is the load exchange once started; ``known`` says whether an
        engine is of this fleet; ``sources`` are the metrics' (they export the
        follower); ``spawn`` runs a background job owned by the router."""
        self.live = live
        self.core = core
        self.loads = loads
        self.redis = redis
        self.replicated = replicated
        self.shared_load = shared_load
        self.known = known
        self.sources = sources
        self.spawn = spawn
        self.sync: DecisionSync | None = None
        """The shared index's follower of the decision stream, while one is needed."""

    def share(self, *_: Config) -> None:
        """Connect what needs sharing now; at start and when a reload changes the
        policy."""
        from router.index.replicated import DecisionSync
        from router.redis.client import replica_id

        sessions = getattr(self.core.policy, "sessions", None)
        redis = self.redis
        if redis is None:
            return
        keeps = isinstance(sessions, SessionMap)
        shared_load = self.shared_load()
        pushes = shared_load is not None and self.live.current.index.redis.load_push
        sync = self.replicated.sync if self.replicated is not None else self.sync
        if sync is None and (keeps or pushes):
            replica = shared_load.replica if shared_load is not None else replica_id()
            sync = self.sync = DecisionSync(
                None, redis, self.live.current.index.replicated, replica, known=self.known
            )
            self.spawn(sync.start(catch_up_timeout=max(redis.admin_timeout, 1.0)))
            self.sources.session_sync = sync
        if pushes and sync is not None and shared_load is not None and sync.load is None:
            sync.load = shared_load
            shared_load.on_change = sync.wake
            self.loads.on_change = shared_load.changed
        if not keeps:  # (no longer) a policy with sessions
            if sync is not None:
                sync.sessions = None
            if self.sync is not None and not pushes:
                self.sync.halt()  # nothing left to publish that anyone reads
                self.sync = None
                self.sources.session_sync = None
            return
        assert sync is not None and isinstance(sessions, SessionMap)
        sessions.on_note = sync.publish_session
        sync.sessions = sessions
        self.sources.session_sync = sync

    def stop_load_pushes(self, shared_load: SharedLoad) -> None:
        """Before the load exchange withdraws this replica: no change may follow the
        withdrawal on the stream (peers would count this replica again until their next
        exchange)."""
        shared_load.on_change = None
        for sync in (self.sync, self.replicated.sync if self.replicated else None):
            if sync is not None:
                sync.load = None

    async def stop(self) -> None:
        if self.sync is not None:
            await self.sync.stop()
