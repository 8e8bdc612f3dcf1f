"""One running router: its components built from the configuration, connected, started
and stopped; the rules live with their concerns (the modules named in
docs/architecture.md, "Process model and lifecycle").

With a shared index (``index.backend: redis``) lookups and decision records go through
a :class:`~router.index.shadow.ShadowedIndex`; in the replicated mode the index is in
memory, and decisions and engine stream snapshots are shared through Redis. With Redis,
a :class:`~router.fleet.shared_load.SharedLoad` exchanges in-flight load with the
other replicas. Tests run several routers in one process, each with its own metrics
registry, index and connections.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from router.admin import Admin
from router.admission import Admission
from router.config import Config, EngineConfig
from router.core import RoutingCore
from router.drain import Drain
from router.events.follow import EventFollowing
from router.fleet.block_size import BlockSizes
from router.fleet.latency import LatencyModel
from router.fleet.load import LoadTracker
from router.fleet.membership import EngineFleet
from router.fleet.pool_client import PoolClient
from router.fleet.registry import Engine, Registry
from router.flow.control import FlowControl
from router.frontends.http.listener import check_free
from router.frontends.http.server import HttpServer
from router.index import KVIndex, index_from_config
from router.index.base import IndexStats
from router.index.remote import RemoteIndex
from router.index.shadow import DecisionShadow, ShadowedIndex
from router.live_config import LiveConfig
from router.metrics import RouterMetrics, StateSources
from router.policy import make_policy
from router.policy.latency import priors_of
from router.proxy import Upstream
from router.reconfigure import follow_config
from router.redis.replicas import ReplicaSharing
from router.response_store import ResponseStore
from router.security import Credentials
from router.serving.decide import Decider
from router.serving.gate import make_gate
from router.serving.picks import PickLedger
from router.serving.services import RunState, Services
from router.session_sharing import SessionSharing
from router.tokenization import Tokenizers

if TYPE_CHECKING:
    from aiohttp import web

    from router.events.snapshots import SnapshotWriter
    from router.events.subscriber import KVEventSubscriber
    from router.fleet.k8s import KubernetesDiscovery
    from router.fleet.monitor import EngineMonitor
    from router.fleet.shared_load import SharedLoad
    from router.frontends.grpc.server import GrpcServers
    from router.index.replicated import DecisionSync, ReplicatedIndex
    from router.redis.client import RedisClient
    from router.reload import Reloader
    from router.tracing import Tracing

log = logging.getLogger("kvroute")


def build_index(config: Config) -> KVIndex:
    """The index the ``index:`` section selects. A router wraps a shared (remote) one
    in a :class:`~router.index.shadow.ShadowedIndex`."""
    index = index_from_config(config.index)
    if not isinstance(index, RemoteIndex):
        return index
    shadow = DecisionShadow(config.index.shadow_window_s, config.index.shadow_max_keys)
    return ShadowedIndex(index, shadow)


def _redis_of(remote: RemoteIndex | None) -> RedisClient | None:
    """The Redis client of a Redis index (built once, with the index), which the load
    exchange, the decision stream and the response store share."""
    if remote is None:
        return None
    from router.index.redis import RedisIndex  # only with a shared index

    return remote.redis if isinstance(remote, RedisIndex) else None


def _replicated_of(index: KVIndex) -> ReplicatedIndex | None:
    # Not imported unless the replicated mode was chosen: then no index can be one.
    module = sys.modules.get("router.index.replicated")
    if module is None or not isinstance(index, module.ReplicatedIndex):
        return None
    return index


class RouterApp:
    """The router's components and their lifecycle."""

    def __init__(
        self, config: Config, index: KVIndex | None = None, tracer_provider: Any = None
    ) -> None:
        live = self.live = LiveConfig(config)
        """The configuration in force; a reload publishes a new one to its subscribers."""
        self.tracing: Tracing | None = None
        if config.tracing.enabled or tracer_provider is not None:
            from router.tracing import Tracing  # nothing of OpenTelemetry unless asked

            self.tracing = Tracing(config.tracing, tracer_provider)
        self.tracer = self.tracing.tracer if self.tracing is not None else None
        """An OpenTelemetry tracer when tracing is on (``tracing.enabled``), else None."""
        self._tasks: list[asyncio.Task[None]] = []
        spawn = self._spawn
        index = self.index = index or build_index(config)
        self.shadowed = index if isinstance(index, ShadowedIndex) else None
        remote = self.remote = self.shadowed.remote if self.shadowed else None
        """The shared index behind the shadow (None with the memory index)."""
        replicated = self.replicated = _replicated_of(index)
        """The in-memory index of the replicated mode (None in the other modes)."""
        self.redis = _redis_of(remote) or (replicated.redis if replicated is not None else None)
        """The Redis of either mode (load sharing, incarnation checks, stored responses)."""
        loads = self.loads = LoadTracker(
            config.block_size, latency=LatencyModel(priors_of(config.policy))
        )
        registry = self.registry = Registry(config.health)
        for engine_cfg in config.engines:
            registry.add(Engine.from_config(engine_cfg))
        self.block_sizes = BlockSizes(live, registry, loads)
        self.block_size_for = self.block_sizes.of
        """The KV block size of a (base) model's pool."""
        events = EventFollowing(live, registry, index, self.block_sizes, spawn, remote, replicated)
        self.events = events
        self.event_writer, self.ingestor = events.writer, events.ingestor
        self.subscribes = events.subscribes  # the events section needs a restart
        """Whether this router follows the engines' KV events itself."""
        self.subscriber: KVEventSubscriber | None = None
        """The KV-event subscriber, once started (None if this router follows none)."""
        self.pool_client = PoolClient(live, registry)
        tokenizers = Tokenizers(config, self.pool_client.post, get=self.pool_client.get)
        self.tokenizers = tokenizers
        make_core = RoutingCore if self.tracing is None else self.tracing.core
        policy = make_policy(config.policy)
        core = make_core(index, policy, config.policy, loads, has_events=events.has_events)
        self.core = core
        core.max_per_engine = config.limits.max_inflight_per_engine
        admission = self.admission = Admission(config.limits)
        loads.on_end = admission.engine_freed
        self.flow: FlowControl | None = None
        """Flow control (``flow.enabled``): bands, fairness, rate limits, shedding."""
        if config.flow.enabled:
            redis_url = config.index.redis.url
            self.flow = FlowControl(config, admission, registry, loads, redis_url)
            core.isolation = self.flow.isolation
            loads.track_prefills = self.flow.isolation is not None
        self.fleet = EngineFleet(
            live, registry, index, loads, core, self.block_sizes, events, tokenizers, spawn
        )
        if replicated is not None:
            replicated.sync.known = self.fleet.serves
        self.picks = PickLedger(loads, config.grpc.pick_ttl_s)
        """Load held by picks that gateways forward themselves (gRPC Pick, ext_proc)."""
        self.picks.on_move = lambda request, engine: core.policy.moved(request, engine)
        self.responses = ResponseStore(config.responses, self.redis)
        """Which engine holds each stored Responses API response."""
        self._index_stats: IndexStats | None = None
        self.metrics = RouterMetrics(
            StateSources(
                core=core,
                registry=registry,
                ingest=events.ingestor.counters,
                index_stats=lambda: self._index_stats,
                shadowed=self.shadowed,
                replicated=replicated,
                writer=events.writer.stats if events.writer else None,
                tokenizers=tokenizers,
                admission=admission,
                flow=self.flow,
            )
        )
        self.metrics.watch_picks(self.picks)
        sources = self.metrics.state.sources
        self.replica_sharing = (
            ReplicaSharing(live, self.redis, loads, self.fleet.serves, replicated, events, sources)
            if self.redis is not None
            else None
        )
        """The load exchange and the replicated mode's snapshots (with Redis)."""
        self.session_sharing = SessionSharing(
            live,
            core,
            loads,
            self.redis,
            replicated,
            lambda: self.shared_load,
            self.fleet.serves,
            sources,
            spawn,
        )
        self.decider = Decider(
            live, registry, core, tokenizers, admission, self.metrics, self.block_size_for
        )
        """Every API's decision path (HTTP, gRPC Pick and Generate, ext_proc)."""
        self.state = RunState()
        """Whether the router drains, and since when it serves (``draining``, ``started_at``)."""
        self.upstream: Upstream | None = None
        self.monitor: EngineMonitor | None = None
        self.discovery: KubernetesDiscovery | None = None
        self.credentials = Credentials(config.auth)
        """Client and admin keys in force (``auth.*``; reloaded on SIGHUP)."""
        self.reloader: Reloader | None = None
        """Set by ``kvroute serve``: re-reads the configuration (SIGHUP, admin reload)."""
        self.admin = Admin(
            registry=registry,
            index=index,
            loads=loads,
            credentials=self.credentials,
            live=live,
            auth_refusals=self.metrics.auth_refusals,
            add_engine=self.fleet.add_engine,
            remove_engine=self.fleet.remove_engine,
            reloader=lambda: self.reloader,
            tokenizers=tokenizers,
        )
        """The admin layer of the HTTP and gRPC admin APIs."""
        self.services = Services(
            live=live,
            registry=registry,
            core=core,
            decider=self.decider,
            admission=admission,
            metrics=self.metrics,
            tokenizers=tokenizers,
            credentials=self.credentials,
            picks=self.picks,
            admin=self.admin,
            block_size_for=self.block_size_for,
            state=self.state,
            responses=self.responses,
            gate=make_gate(admission, self.flow, self.state, loads, live),
            flow=self.flow,
        )
        """What the front ends receive of the router (:mod:`router.serving.services`)."""
        self.http = HttpServer(self.services, self.tracer)
        self.observer, self.connections = self.http.observer, self.http.connections
        sources.connections = self.connections
        self.drain_state = Drain(self.state, self.observer)
        self.url = ""
        self.grpc: GrpcServers | None = None
        self.grpc_port: int | None = None
        """The gRPC API's bound port (``grpc.port``), once started."""
        self.extproc_port: int | None = None
        """The Envoy ext_proc listener's bound port (``extproc.port``), once started."""
        follow_config(self.services, self.session_sharing, self.observer, self.fleet)

    # ------------------------------------------------------------------ what others read

    @property
    def config(self) -> Config:
        """The configuration in force (the current one after a reload)."""
        return self.live.current

    @property
    def session_sync(self) -> DecisionSync | None:
        """The shared index's follower of the decision stream (session pins, load)."""
        return self.session_sharing.sync

    @property
    def draining(self) -> bool:
        return self.state.draining

    @property
    def shared_load(self) -> SharedLoad | None:
        """The exchange of in-flight load with the other replicas (Redis), once started."""
        return self.replica_sharing.shared_load if self.replica_sharing else None

    @property
    def snapshots(self) -> SnapshotWriter | None:
        """The replicated mode's writer of engine stream snapshots, once started."""
        return self.replica_sharing.snapshots if self.replica_sharing else None

    def web_app(self) -> web.Application:
        return self.http.app()

    def add_engine(self, cfg: EngineConfig) -> Engine:
        """Register an engine while running (:meth:`EngineFleet.add_engine`)."""
        return self.fleet.add_engine(cfg)

    async def remove_engine(self, endpoint: str) -> Engine | None:
        """Forget an engine (:meth:`EngineFleet.remove_engine`)."""
        return await self.fleet.remove_engine(endpoint)

    # ------------------------------------------------------------------ lifecycle

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a background job owned by the app (cancelled by ``stop``)."""
        task = asyncio.ensure_future(coro)
        self._tasks.append(task)
        task.add_done_callback(lambda t: t in self._tasks and self._tasks.remove(t))

    async def start(self) -> str:
        """Start everything and listen; returns the bound URL.

        The HTTP port is bound first: a taken one raises :class:`ListenError` before any
        engine, KV-event stream or Redis is contacted."""
        await self.http.bind()
        for what, section in (("gRPC API", self.config.grpc), ("ext_proc", self.config.extproc)):
            if section.port:  # bound once the engines are known; a taken port fails now
                check_free(section.host or self.config.server.host, section.port, what)
        make_upstream = Upstream if self.tracing is None else self.tracing.upstream
        self.upstream = make_upstream(self.config.proxy)
        self.upstream.own_authorization = self.credentials.upstream_authorization(None)
        self.services.upstream = self.pool_client.upstream = self.upstream
        if self.remote is not None:
            self.remote.listeners.append(self.events.on_index_availability)
        if self.replica_sharing is not None:
            await self.replica_sharing.start()
        self.subscriber = await self.events.start()
        if self.subscriber is not None:
            self.metrics.state.sources.subscriber = self.subscriber.stats
        self.monitor = self.fleet.monitored(self.upstream)
        await self.monitor.start()
        await self.events.synced()  # the replays land before any decision's record
        self.discovery = self.fleet.kubernetes(self.metrics.registry)
        if self.discovery is not None:
            await self.discovery.start()
        self.session_sharing.share()  # before the replicated catch-up: it replays peers' pins
        if self.replica_sharing is not None:
            await self.replica_sharing.catch_up()
        self._tasks.append(asyncio.ensure_future(self._refresh_index_stats()))
        if self.http.tls is not None:
            self._spawn(self.http.tls.watch())
        self.url = await self.http.serve()
        if self.config.grpc.port is not None or self.config.extproc.port is not None:
            await self._start_grpc()
        self.state.started_at = time.time()
        return self.url

    async def _start_grpc(self) -> None:
        """The gRPC API and ext_proc listeners (grpc loads only when one is asked for)."""
        from router.frontends.grpc.server import GrpcServers

        self.grpc = GrpcServers.serving(self.services, self.drain_state)
        await self.grpc.start()
        self.grpc_port, self.extproc_port = self.grpc.grpc_port, self.grpc.extproc_port

    async def _refresh_index_stats(self) -> None:
        while True:
            try:
                self._index_stats = await self.index.stats()
            except Exception:  # the index may be briefly unavailable; keep the last value
                log.debug("index stats unavailable", exc_info=True)
            await asyncio.sleep(5.0)

    def begin_drain(self) -> None:
        """Stop reporting ready (HTTP and gRPC health); in-flight requests continue."""
        self.drain_state.begin()

    async def drain(self, timeout_s: float) -> int:
        """Graceful shutdown before ``stop`` (:meth:`Drain.run`); returns how many
        requests had to be cancelled."""
        return await self.drain_state.run(timeout_s, self.http.stop_accepting)

    async def stop(self) -> None:
        self.begin_drain()
        if self.replica_sharing is not None:
            await self.replica_sharing.stop_snapshots()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.discovery is not None:
            await self.discovery.stop()
        if self.grpc is not None:
            await self.grpc.stop()
            self.grpc = None
        self.picks.clear()
        await self.http.close()
        if self.monitor is not None:
            await self.monitor.stop()
        await self.tokenizers.stop()
        if self.remote is not None and self.events.on_index_availability in self.remote.listeners:
            self.remote.listeners.remove(self.events.on_index_availability)
        await self.events.close()
        if self.upstream is not None:
            await self.upstream.close()
        if self.replica_sharing is not None:
            await self.replica_sharing.stop_load_exchange(self.session_sharing.stop_load_pushes)
        await self.session_sharing.stop()
        await self.index.close()
        if self.flow is not None:
            await self.flow.close()
        if self.tracing is not None:
            self.tracing.shutdown()  # flushes spans not exported yet
