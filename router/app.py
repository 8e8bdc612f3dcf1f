"""One running router: every component built from the configuration, started and stopped.

``kvroute serve`` runs one :class:`RouterApp` in one asyncio process. Tests run several
in one process (each has its own metrics registry, index and client session).

With a shared backend (``index.backend: redis``, a
:class:`~router.index.remote.RemoteIndex`) the router shares the index with its
replicas: lookups and decision records go through a
:class:`~router.index.shadow.ShadowedIndex` (records off the request path, a local
shadow of decisions while the shared index is away), and its own KV-event subscriber (if
on) writes through a :class:`~router.events.writer.RemoteEventWriter`. When the shared
index comes back after an outage, the engine streams whose writes were lost (all of
them, if it lost its data) are rewritten from what the subscriber knows each engine
holds. With Redis, a :class:`~router.engines.shared_load.SharedLoad` task also exchanges
in-flight load with the other replicas.

In the replicated mode (``index.backend: replicated``, a
:class:`~router.index.replicated.ReplicatedIndex`) the index is in memory and fed by the
router's own subscriber, as with the memory backend; decisions are shared through a
Redis stream, load as above, and the engine streams' snapshots that one replica writes
let a starting replica follow each engine from a recent batch instead of from nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from router.admin import Admin
from router.admission import Admission
from router.api.admin_http import AdminHttp
from router.api.decide import Decider
from router.api.engine_routes import is_client_path
from router.api.errors import ApiError
from router.api.http import HttpApi, error_response, openai_errors
from router.api.listener import BoundSite, ConnectionGuard, bind, check_free
from router.api.observe import RequestObserver
from router.api.picks import PickLedger
from router.api.services import RunState, Services
from router.config import Config, EngineConfig, IndexConfig
from router.core import RoutingCore
from router.engines.latency import LatencyModel
from router.engines.load import LoadTracker
from router.engines.monitor import EngineMonitor
from router.engines.registry import Engine, EngineState, Registry, endpoint_of
from router.events.ingest import EventIngestor, StreamState
from router.events.publishers import CurveKeys, is_loopback
from router.events.subscriber import EventSource, KVEventSubscriber, parse_llmd_topic
from router.flow.control import FlowControl
from router.index import KVIndex, MemoryIndex, index_from_config
from router.index.base import IndexStats, IndexUnavailable
from router.index.remote import RemoteIndex
from router.index.shadow import DecisionShadow, ShadowedIndex
from router.live_config import LiveConfig
from router.metrics import RouterMetrics, StateSources
from router.policy import make_policy
from router.policy.latency import priors_of
from router.proxy import Upstream, UpstreamError
from router.response_store import ResponseStore
from router.security import AuthError, Credentials, ServerTLS
from router.sessions import SessionMap
from router.tokenization import Tokenizers, TokenizerUnavailable
from router.types import EngineKey, Tier

if TYPE_CHECKING:
    from router.engines.k8s import KubernetesDiscovery
    from router.engines.shared_load import SharedLoad
    from router.events.snapshots import Snapshot, SnapshotWriter
    from router.events.writer import RemoteEventWriter
    from router.grpc.server import GrpcServers
    from router.index.replicated import DecisionSync, ReplicatedIndex
    from router.redis.client import RedisClient
    from router.reload import Reloader

log = logging.getLogger("kvroute")

#: Bound on one pipelined write of the router's own KV-event batches (off the request
#: path; a frozen Redis is noticed by lookups within the budget anyway).
EVENT_WRITE_TIMEOUT_S = 1.0


def build_index(config: Config) -> KVIndex:
    """The index the ``index:`` section selects. A router wraps a shared (remote) one
    in a :class:`~router.index.shadow.ShadowedIndex`."""
    index = index_from_config(config.index)
    if not isinstance(index, RemoteIndex):
        return index
    shadow = DecisionShadow(config.index.shadow_window_s, config.index.shadow_max_keys)
    return ShadowedIndex(index, shadow)


def _map_bound(config: IndexConfig, index: KVIndex) -> int:
    """Engine hashes an event stream's map keeps per tier (0: no limit): at most
    ``index.max_entries_per_engine``, and with the in-memory index no more than it holds
    in all. The blocks of forgotten hashes leave the index with them."""
    caps = [config.max_entries_per_engine]
    if isinstance(index, MemoryIndex):
        caps.append(config.max_entries)
    return min((c for c in caps if c), default=0)


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
        self.live = LiveConfig(config)
        """The configuration in force; a reload publishes a new one to its subscribers."""
        self.tracer: Any = None
        """An OpenTelemetry tracer when tracing is on (``tracing.enabled``), else None."""
        self._tracer_provider: Any = None
        if config.tracing.enabled or tracer_provider is not None:
            from router.tracing import tracer_of
            from router.tracing import tracer_provider as make_provider

            provider = tracer_provider or make_provider(config.tracing)
            if tracer_provider is None:
                self._tracer_provider = provider  # ours to flush and shut down
            self.tracer = tracer_of(provider)
        self.tokenizers = Tokenizers(config, self._post_to_pool, get=self._get_from_pool)
        self.index = index or build_index(config)
        self.shadowed = self.index if isinstance(self.index, ShadowedIndex) else None
        self.remote: RemoteIndex | None = self.shadowed.remote if self.shadowed else None
        """The shared index behind the shadow (None with the memory index)."""
        self.replicated = _replicated_of(self.index)
        """The in-memory index of the replicated mode (None in the other modes)."""
        self.redis = _redis_of(self.remote) or (
            self.replicated.redis if self.replicated is not None else None
        )
        """The Redis of the shared index or of the replicated mode (load sharing,
        incarnation checks, stored responses)."""
        self.snapshots: SnapshotWriter | None = None
        """The replicated mode's writer of engine stream snapshots."""
        self._warm: dict[EngineKey, Snapshot] = {}
        """Replicated mode: snapshots loaded at start, taken by each engine's first
        subscription."""
        self.loads = LoadTracker(config.block_size, latency=LatencyModel(priors_of(config.policy)))
        self._adopted_block_sizes: dict[str, int] = {}
        """Block sizes pools without a configured one took from their first engine."""
        self.registry = Registry(config.health)
        for engine_cfg in config.engines:
            self.registry.add(Engine.from_config(engine_cfg))
        self.registry.listeners.append(self._on_state_change)
        policy = make_policy(config.policy)
        core_class = RoutingCore
        if self.tracer is not None:
            from router.tracing import TracedRoutingCore

            core_class = TracedRoutingCore
        self.core = core_class(
            self.index, policy, config.policy, self.loads, has_events=self._has_events
        )
        if self.tracer is not None:
            self.core.tracer = self.tracer  # type: ignore[attr-defined]
        self.core.max_per_engine = config.limits.max_inflight_per_engine
        self.admission = Admission(config.limits)
        self.loads.on_end = self.admission.engine_freed
        self.flow: FlowControl | None = (
            FlowControl(config, self.admission, self.registry, self.loads, config.index.redis.url)
            if config.flow.enabled
            else None
        )
        """Flow control (``flow.enabled``): bands, fairness, rate limits, shedding."""
        if self.flow is not None:
            self.core.isolation = self.flow.isolation
            self.loads.track_prefills = self.flow.isolation is not None
        self.event_writer = self._event_writer()
        self.ingestor = self.event_writer or EventIngestor(
            self.index,
            on_block_size_mismatch=self._block_size_mismatch,
            max_blocks_per_engine=_map_bound(config.index, self.index),
        )
        if self.replicated is not None:
            self.replicated.sync.known = self._serves
        self.picks = PickLedger(self.loads, config.grpc.pick_ttl_s)
        """Load held by picks that gateways forward themselves (gRPC Pick, ext_proc)."""
        self.picks.on_move = lambda request, engine: self.core.policy.moved(request, engine)
        self.responses = ResponseStore(config.responses, self.redis)
        """Which engine holds each stored Responses API response (shared through Redis
        when the index is)."""
        self.subscriber: KVEventSubscriber | None = None
        self.shared_load: SharedLoad | None = None
        self.session_sync: DecisionSync | None = None
        """The shared index's exchange of session pins (the replicated mode's decision
        stream carries them itself)."""
        self._unsynced: set[EngineKey] = set()
        """Engine streams some of whose event batches never reached Redis."""
        self._mismatch_warned: set[EngineKey] = set()
        """Streams whose block-size mismatch was logged: one line each, not one per event."""
        self._resync_pending = False
        self.event_resync_retry_s = 5.0
        """After Redis refused event writes while reachable, rewrite the streams then."""
        self._index_stats: IndexStats | None = None
        self.metrics = RouterMetrics(
            StateSources(
                core=self.core,
                registry=self.registry,
                ingest=self.ingestor.counters,
                index_stats=lambda: self._index_stats,
                shadowed=self.shadowed,
                replicated=self.replicated,
                writer=self.event_writer.stats if self.event_writer else None,
                tokenizers=self.tokenizers,
                admission=self.admission,
                flow=self.flow,
            )
        )
        self.metrics.watch_picks(self.picks)
        self.decider = Decider(
            self.live,
            self.registry,
            self.core,
            self.tokenizers,
            self.admission,
            self.metrics,
            self.block_size_for,
        )
        """Every API's decision path (HTTP, gRPC Pick and Generate, ext_proc)."""
        self._turn = 0
        self.state = RunState()
        """Whether the router drains, and since when it serves (``draining``, ``started_at``)."""
        self.drain_listeners: list[Callable[[], None]] = []
        """Called once when the router starts draining (health checks report not ready)."""
        self.drain_hooks: list[Callable[[float], Awaitable[None]]] = []
        """Awaited by ``drain`` with its timeout: other listeners (gRPC) stop accepting and
        wait for their in-flight calls."""
        self.upstream: Upstream | None = None
        self.monitor: EngineMonitor | None = None
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.url = ""
        self.discovery: KubernetesDiscovery | None = None
        self.http_api: HttpApi | None = None
        self.observer = RequestObserver(config.server.access_log, self.tracer)
        self.credentials = Credentials(config.auth)
        """Client and admin keys in force (``auth.*``; reloaded on SIGHUP)."""
        self.server_tls: ServerTLS | None = None
        self.connections = ConnectionGuard(
            config.server.max_connections,
            config.server.header_timeout_s,
            config.server.body_timeout_s,
            config.server.keepalive_timeout_s,
        )
        """Client connections of the HTTP listener: their cap and timeouts."""
        self._bound: asyncio.Server | None = None
        self.metrics.state.sources.connections = self.connections
        self.reloader: Reloader | None = None
        """Set by ``kvroute serve``: re-reads the configuration (SIGHUP, admin reload)."""
        self.admin = Admin(
            registry=self.registry,
            index=self.index,
            loads=self.loads,
            credentials=self.credentials,
            live=self.live,
            auth_refusals=self.metrics.auth_refusals,
            add_engine=self.add_engine,
            remove_engine=self.remove_engine,
            reloader=lambda: self.reloader,
            tokenizers=self.tokenizers,
        )
        """The admin layer of the HTTP and gRPC admin APIs."""
        """Counts in-flight HTTP requests (for draining) and writes the access log."""
        self.grpc: GrpcServers | None = None
        self.grpc_port: int | None = None
        """The gRPC API's bound port (``grpc.port``), once started."""
        self.extproc_port: int | None = None
        """The Envoy ext_proc listener's bound port (``extproc.port``), once started."""
        self._follow_config()

    # ------------------------------------------------------------------ wiring

    @property
    def config(self) -> Config:
        """The configuration in force (the current one after a reload)."""
        return self.live.current

    def _follow_config(self) -> None:
        """Who applies which section when a reload publishes a new configuration (code
        that reads ``self.config`` where it uses a value needs no subscription)."""
        live = self.live
        live.subscribe(
            "routing core",
            ("policy", "limits"),
            lambda new, _: self.core.reconfigure(new.policy, new.limits.max_inflight_per_engine),
        )
        live.subscribe("decider", ("policy", "disaggregation"), self._new_decider)
        live.subscribe("session sharing", ("policy",), self._share_sessions)
        live.subscribe("registry", ("health",), self._new_health)
        live.subscribe("admission", ("limits",), self._new_limits)
        live.subscribe("request observer", ("server",), self._new_server)
        live.subscribe("upstream", ("proxy", "auth"), self._new_proxy)
        live.subscribe("engine monitor", ("health", "scrape", "auth", "limits"), self._new_monitor)
        live.subscribe("engines", ("engines",), self._new_engines)

    def _new_decider(self, new: Config, old: Config) -> None:
        self.decider.reconfigure()  # the decode choice from the new weights

    def _new_health(self, new: Config, old: Config) -> None:
        self.registry.health = new.health

    def _new_limits(self, new: Config, old: Config) -> None:
        self.admission.limits = new.limits

    def _new_server(self, new: Config, old: Config) -> None:
        self.observer.access_log_info = new.server.access_log

    def _new_proxy(self, new: Config, old: Config) -> None:
        if self.upstream is not None:  # else built from the current one at start
            self.upstream.reconfigure(new.proxy, self.credentials.upstream_authorization(None))

    def _new_monitor(self, new: Config, old: Config) -> None:
        if self.monitor is not None:
            self.monitor.config = new

    async def _new_engines(self, new: Config, old: Config) -> None:
        """Removed and changed engines go (with their index entries), new ones come."""
        before = {endpoint_of(e.url): e for e in old.engines}
        after = {endpoint_of(e.url): e for e in new.engines}
        for endpoint, cfg in before.items():
            if after.get(endpoint) != cfg:
                await self.remove_engine(endpoint)
                log.info("engine %s removed by reload", cfg.url)
        for endpoint, cfg in after.items():
            if before.get(endpoint) != cfg:
                self.add_engine(cfg)
                log.info("engine %s added by reload", cfg.url)

    @property
    def subscribes(self) -> bool:
        """Whether this router follows the engines' KV events itself."""
        return self.config.events.enabled and not self.config.events.via_indexer

    def _event_writer(self) -> RemoteEventWriter | None:
        """With a shared index, the subscriber's events go through a batching writer."""
        if self.remote is None or not self.subscribes:
            return None
        from router.events.writer import RemoteEventWriter

        # Unfenced: several replicas may write the same engine's events; the writes are
        # idempotent, and a standalone indexer is the fenced alternative.
        return RemoteEventWriter(
            self.remote,
            on_block_size_mismatch=self._block_size_mismatch,
            on_lost=self._event_writes_lost,
            write_timeout=EVENT_WRITE_TIMEOUT_S,
            max_blocks_per_engine=_map_bound(self.config.index, self.index),
        )

    def _has_events(self, key: EngineKey) -> bool:
        if self.config.events.via_indexer:
            engine = self.registry.engine_of(key)
            return engine is not None and engine.wants_events
        if self.subscriber is None:
            return False
        return self.subscriber.stream_state(key) is not None

    def _event_writes_lost(self, engine: EngineKey, reason: str) -> None:
        # Unfenced writes fail only when the index does; the stream is rewritten from
        # what the subscriber knows the engine holds once it answers again. If it
        # answered with an error instead (Redis out of memory, say), no return will be
        # announced: try again a little later.
        self._unsynced.add(engine)
        if self.remote is not None and self.remote.available and not self._resync_pending:
            self._resync_pending = True
            self._spawn(self._resync_later())

    async def _resync_later(self) -> None:
        try:
            await asyncio.sleep(self.event_resync_retry_s)
        finally:
            self._resync_pending = False
        if self.remote is not None and self.remote.available:
            self._resync_event_streams(data_lost=False)

    def _on_index_availability(self, available: bool, data_lost: bool) -> None:
        if available:
            self._resync_event_streams(data_lost)

    def _resync_event_streams(self, data_lost: bool) -> None:
        """Rewrite into the shared index the engine streams whose writes were lost (every
        stream this router follows, if it lost its data)."""
        writer = self.event_writer
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

    def _on_state_change(self, engine: Engine, previous: EngineState) -> None:
        if previous is EngineState.EJECTED and engine.state is EngineState.HEALTHY:
            # It was unreachable: it may have restarted with an empty cache.
            if self.subscriber is not None:
                for key in engine.keys:
                    self.subscriber.resync(key)

    def _spawn(self, coro: Any) -> None:
        """Run a background job owned by the app (cancelled by ``stop``)."""
        task = asyncio.ensure_future(coro)
        self._tasks.append(task)
        task.add_done_callback(lambda t: t in self._tasks and self._tasks.remove(t))

    @property
    def draining(self) -> bool:
        return self.state.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.state.draining = value

    @property
    def started_at(self) -> float:
        return self.state.started_at

    @started_at.setter
    def started_at(self, value: float) -> None:
        self.state.started_at = value

    @functools.cached_property
    def services(self) -> Services:
        """What the front ends receive of the router (:mod:`router.api.services`)."""
        return Services(
            live=self.live,
            registry=self.registry,
            core=self.core,
            decider=self.decider,
            admission=self.admission,
            metrics=self.metrics,
            tokenizers=self.tokenizers,
            credentials=self.credentials,
            picks=self.picks,
            admin=self.admin,
            block_size_for=self.block_size_for,
            state=self.state,
            responses=self.responses,
            upstream=self.upstream,
            flow=self.flow,
        )

    def block_size_for(self, model: str) -> int:
        """The KV block size of a (base) model's pool: configured, else adopted from the
        pool's engines, else the default."""
        if not self.config.block_size_configured(model):
            adopted = self._adopted_block_sizes.get(model)
            if adopted is not None:
                return adopted
        return self.config.model_settings(model)[1]

    def _adopt_block_size(self, model: str, block_size: int) -> None:
        """A pool without a configured block size takes its first engine's."""
        if self.config.block_size_configured(model) or model in self._adopted_block_sizes:
            return
        self._adopted_block_sizes[model] = block_size
        if block_size != self.config.block_size:
            log.info(
                "model %r: KV block size %d, as its engines report (no block_size configured)",
                model,
                block_size,
            )
        self.loads.block_size = block_size

    def _block_size_mismatch(self, key: EngineKey, expected: int, got: int) -> None:
        """An event used another block size than the engine's: it is dropped and counted
        (``kvroute_kv_events_block_size_mismatch_total``), and the engine stays. Events
        are not authenticated (in bind mode any publisher may name any engine), so only
        the engine's own reports (/server_info, /metrics) may refuse it."""
        if key in self._mismatch_warned:
            return
        self._mismatch_warned.add(key)
        log.warning(
            "KV events of %s use block size %d, not the engine's %d: dropped (if the "
            "engine does use %d, set --block-size or models[].block_size to match)",
            key.label,
            got,
            expected,
            got,
        )

    async def _check_block_size(self, engine: Engine) -> bool:
        """Refuse an engine whose block size differs from its pool's; True if it fits."""
        if engine.block_size is None:
            return True
        for model in self.registry.base_models(engine):
            self._adopt_block_size(model, engine.block_size)
            pool = self.block_size_for(model)
            if engine.block_size != pool:
                reason = (
                    f"engine {engine.url} uses KV block size {engine.block_size} but the "
                    f"pool of model {model!r} uses {pool}; set --block-size (or "
                    f"models[].block_size) to match, or fix the engine"
                )
                log.error("refusing %s", reason)
                self.registry.refuse(engine, reason)
                if self.subscriber is not None:
                    for key in engine.keys:
                        await self.subscriber.remove_source(key, clear=True)
                return False
        return True

    async def _post_to_pool(self, model: str, path: str, body: bytes) -> tuple[int, bytes]:
        """POST to a healthy engine serving ``model`` (rotating), for tokenization."""
        return await self._call_pool(model, "POST", path, body)

    async def _get_from_pool(self, model: str, path: str) -> tuple[int, bytes]:
        """GET from a healthy engine serving ``model`` (what it serves, for the tokenizer)."""
        return await self._call_pool(model, "GET", path, b"")

    async def _call_pool(
        self, model: str, method: str, path: str, body: bytes
    ) -> tuple[int, bytes]:
        engines = [e for e in self.registry if model in e.models and e.state is EngineState.HEALTHY]
        if not engines or self.upstream is None:
            raise TokenizerUnavailable(f"no healthy engine serves {model!r}")
        self._turn += 1
        engine = engines[self._turn % len(engines)]
        try:
            return await self.upstream.call(
                method, engine.url + path, body, self.config.health.timeout_s * 2
            )
        except UpstreamError as exc:
            raise TokenizerUnavailable(str(exc)) from None

    async def _on_discovered(self, engine: Engine) -> None:
        if not await self._check_block_size(engine):
            return
        # Discovery follows a passing probe: admit the engine now that its block size
        # fits, before the tokenizer probe below, which needs a healthy engine.
        self.registry.probe_succeeded(engine)
        await self._subscribe(engine)
        for model in self.registry.base_models(engine):
            await self.tokenizers.resolve(model)

    async def _on_block_size(self, engine: Engine) -> None:
        await self._check_block_size(engine)

    async def _subscribe(self, engine: Engine) -> None:
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
                block_size=self.block_size_for(bases[0]),
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

    def _warm_start(self, source: EventSource) -> Snapshot | None:
        """Replicated mode: the engine's stored snapshot, its blocks put in the index, if
        one was loaded at start and describes this stream (same model and block size)."""
        warm = self._warm.pop(source.engine, None)
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

    async def _bind_events(self, subscriber: KVEventSubscriber) -> None:
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
            EngineKey(endpoint, rank or 0), model, block_size=self.block_size_for(model)
        )

    async def _refresh_index_stats(self) -> None:
        while True:
            try:
                self._index_stats = await self.index.stats()
            except Exception:  # the index may be briefly unavailable; keep the last value
                log.debug("index stats unavailable", exc_info=True)
            await asyncio.sleep(5.0)

    # ------------------------------------------------------------------ run-time fleet changes

    def add_engine(self, cfg: EngineConfig) -> Engine:
        """Register an engine while running (admin API, Kubernetes discovery).

        A first probe and discovery (models, block size, KV events) run in the
        background; the engine becomes a candidate once its probe passes. Adding a known
        URL replaces its settings.
        """
        engine = self.registry.add(Engine.from_config(cfg))
        if self.monitor is not None:
            self._spawn(self.monitor.probe(engine))
        return engine

    async def remove_engine(self, endpoint: str) -> Engine | None:
        """Forget an engine: no more routing, its KV-event streams and index entries go."""
        engine = self.registry.remove(endpoint)
        if engine is None:
            return None
        for key in engine.keys:
            if self.subscriber is not None:
                await self.subscriber.remove_source(key, clear=True)
            with contextlib.suppress(IndexUnavailable):  # Redis down: entries age out
                await self.index.clear(key)
            self.core.forget(key)
        return engine

    def begin_drain(self) -> None:
        """Stop reporting ready (HTTP and gRPC health); in-flight requests continue."""
        if self.draining:
            return
        self.draining = True
        for listener in self.drain_listeners:
            listener()

    async def drain(self, timeout_s: float) -> int:
        """Graceful shutdown, before ``stop``: report not ready, stop accepting connections,
        let in-flight requests (streams included) finish for up to ``timeout_s``, then
        cancel the rest. Returns how many had to be cancelled."""
        self.begin_drain()
        if self._runner is not None:
            for site in list(self._runner.sites):
                await site.stop()  # new connections are refused from here on
            server = self._runner.server
            if server is not None and hasattr(server, "pre_shutdown"):
                server.pre_shutdown()  # idle keep-alives close, busy ones after their answer
        hooks = asyncio.gather(*(hook(timeout_s) for hook in self.drain_hooks))
        inflight = self.observer.inflight
        if inflight:
            log.info("draining: waiting up to %.0f s for %d request(s)", timeout_s, inflight)
        left = await self.observer.wait_idle(timeout_s)
        await asyncio.gather(hooks, return_exceptions=True)
        if left:
            log.warning("drain deadline passed: cancelling %d request(s) still running", left)
            self.observer.cancel_all()
            await self.observer.wait_idle(5.0)
        return left

    # ------------------------------------------------------------------ lifecycle

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Client keys on the client API (/v1/* and the engine routes outside it, and
        /metrics when asked; ``x-api-key`` where ``auth.accept_x_api_key`` takes it); admin
        calls are checked by the admin layer, probes and the OpenAPI document stay open."""
        path = request.path
        if is_client_path(path) or (path == "/metrics" and self.credentials.metrics_need_key):
            try:
                self.credentials.check_http(request.headers, path)
            except AuthError as exc:
                self.metrics.auth_refusals.labels("http", "client", str(exc.status)).inc()
                return error_response(
                    ApiError(exc.status, exc.message, code="invalid_api_key"),
                    None,
                    extra_headers={"WWW-Authenticate": 'Bearer realm="kvroute"'},
                    path=path,
                )
        return await handler(request)

    def web_app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.limits.max_body_bytes,
            middlewares=[
                self.connections.middleware,
                self.observer.middleware,
                openai_errors,
                self._authenticate,
            ],
        )
        self.http_api = HttpApi(self.services)
        app.add_routes(self.http_api.routes())
        app.add_routes(AdminHttp(self.admin, self.live).routes())
        return app

    async def start(self) -> str:
        """Start everything and listen; returns the bound URL.

        The HTTP port is bound first: a taken one raises :class:`ListenError` before any
        engine, KV-event stream or Redis is contacted."""
        server_cfg = self.config.server
        ssl_context = None
        if self.config.tls.on("http"):
            self.server_tls = ServerTLS(self.config.tls)
            ssl_context = self.server_tls.context
        # The connections' protocol and its settings are the listener's (router.api.listener).
        self._runner = web.AppRunner(self.web_app(), handler_cancellation=True)
        await self._runner.setup()
        self._bound = await bind(
            server_cfg.host, server_cfg.port, self.connections, self._runner, ssl_context
        )
        for what, section in (("gRPC API", self.config.grpc), ("ext_proc", self.config.extproc)):
            if section.port:  # bound once the engines are known; a taken port fails now
                check_free(section.host or server_cfg.host, section.port, what)
        if self.tracer is not None:
            from router.tracing import TracedUpstream

            self.upstream = TracedUpstream(self.config.proxy)
            self.upstream.tracer = self.tracer
        else:
            self.upstream = Upstream(self.config.proxy)
        self.upstream.own_authorization = self.credentials.upstream_authorization(None)
        self.services.upstream = self.upstream
        if self.remote is not None:
            self.remote.listeners.append(self._on_index_availability)
        if self.redis is not None:
            await self._start_redis(self.redis)
        if self.subscribes:
            self.subscriber = KVEventSubscriber(
                self.ingestor,
                replay_timeout=self.config.events.replay_timeout_s,
                max_message_bytes=self.config.events.max_message_bytes,
            )
            self.metrics.state.sources.subscriber = self.subscriber.stats
            if self.config.events.bind_endpoint:
                await self._bind_events(self.subscriber)
        self.monitor = EngineMonitor(
            self.config,
            self.registry,
            self.upstream,
            self.loads,
            self._on_discovered,
            self._on_block_size,
        )
        await self.monitor.start()
        if self.subscriber is not None:
            await self.subscriber.wait_synced(self.config.events.replay_timeout_s * 2)
        if self.event_writer is not None:
            # Likewise for Redis: the replays' writes land before any decision's record.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.event_writer.drain(), EVENT_WRITE_TIMEOUT_S)
        if self.config.discovery.kubernetes.enabled:
            from router.engines.k8s import DiscoveryCollector, KubernetesDiscovery

            self.discovery = KubernetesDiscovery(self, self.config.discovery.kubernetes)
            self.metrics.registry.register(DiscoveryCollector(self.discovery))
            await self.discovery.start()
        self._share_sessions()  # before the replicated catch-up: it replays peers' pins
        if self.replicated is not None and self.redis is not None:
            await self._start_replicated(self.replicated, self.redis)
        self._tasks.append(asyncio.ensure_future(self._refresh_index_stats()))
        if self.server_tls is not None:
            self._spawn(self.server_tls.watch())
        host, port = self._bound.sockets[0].getsockname()[:2]
        await BoundSite(self._runner, self._bound, f"{host}:{port}").start()
        shown = f"[{host}]" if ":" in host else host
        self.url = f"{'https' if ssl_context else 'http'}://{shown}:{port}"
        if self.config.grpc.port is not None or self.config.extproc.port is not None:
            await self._start_grpc()
        self.started_at = time.time()
        return self.url

    async def _start_grpc(self) -> None:
        """The gRPC API and ext_proc listeners (grpc loads only when one is asked for)."""
        from router.api.extproc import ExtProcService
        from router.api.grpc import AdminService, RouterService
        from router.grpc.server import GrpcServers, Servicers

        self.grpc = GrpcServers(
            self.config,
            Servicers(
                router=lambda: RouterService(self.services),
                admin=lambda: AdminService(self.services),
                extproc=lambda: ExtProcService(self.services),
            ),
            registry=self.registry,
            picks=self.picks,
            credentials=self.credentials,
            metrics=self.metrics,
            draining=lambda: self.draining,
            drain_listeners=self.drain_listeners,
        )
        await self.grpc.start()
        self.grpc_port, self.extproc_port = self.grpc.grpc_port, self.grpc.extproc_port

    async def _start_redis(self, redis: RedisClient) -> None:
        from router.engines.shared_load import SharedLoad

        # Learn Redis's incarnation now, so that after an outage the router can tell a
        # Redis that kept its data from one that restarted empty.
        with contextlib.suppress(IndexUnavailable):
            await redis.check_incarnation(timeout=max(redis.budget, 1.0))
        cfg = self.config.index.redis
        if cfg.share_load:
            self.shared_load = SharedLoad(
                redis,
                self.loads,
                lambda key: self.registry.engine_of(key) is not None,
                replica=self.replicated.replica if self.replicated is not None else None,
                interval=cfg.load_interval_s,
                ttl=cfg.load_ttl_s,
            )
            self.shared_load.start()
            self.metrics.state.sources.shared_load = self.shared_load
        if self.replicated is not None:
            await self._load_snapshots(redis)

    async def _load_snapshots(self, redis: RedisClient) -> None:
        """Replicated mode, before any engine is subscribed: the engine streams'
        snapshots, taken as each engine is subscribed during start."""
        from router.events.snapshots import load_snapshots

        if not self.subscribes or self.config.index.replicated.snapshot_interval_s <= 0:
            return
        try:
            self._warm = await load_snapshots(redis)
        except Exception as exc:  # no snapshot is no reason not to start: start cold
            log.warning("replicated index: no engine snapshots to start from (%s)", exc)
        else:
            log.info("replicated index: %d engine snapshot(s) to start from", len(self._warm))

    async def _start_replicated(self, index: ReplicatedIndex, redis: RedisClient) -> None:
        """Once the engines are subscribed (and known, for peers' decisions about them):
        read the peers' decisions still live, then follow the decision stream and write
        snapshots in the background. Snapshots not taken by now are dropped: a later
        engine starts from its own events, not from a snapshot of unknown age."""
        from router.events.snapshots import SnapshotWriter

        self._warm.clear()
        await index.sync.start(catch_up_timeout=max(redis.admin_timeout, 1.0))
        cfg = self.config.index.replicated
        if self.subscribes and cfg.snapshot_interval_s > 0:
            self.snapshots = SnapshotWriter(
                redis, index.replica, cfg.snapshot_interval_s, self._stream_states
            )
            self.snapshots.start()
            self.metrics.state.sources.snapshots = self.snapshots

    def _share_sessions(self, *_: Any) -> None:
        """With Redis (either mode): the decision stream carries what replicas tell each
        other at once. With a policy that keeps sessions (``latency``) its session pins
        go to the other replicas and theirs come back, so a conversation's next turn
        finds its engine whichever replica it reaches; with ``index.redis.load_push``,
        changes of in-flight load go and come back too. In the shared index's mode a
        follower of the stream (:attr:`session_sync`) lives while either needs it.
        Called at start and when a reload changes the policy."""
        from router.index.replicated import DecisionSync
        from router.redis.client import replica_id

        sessions = getattr(self.core.policy, "sessions", None)
        redis = self.redis
        if redis is None:
            return
        keeps = isinstance(sessions, SessionMap)
        pushes = self.shared_load is not None and self.config.index.redis.load_push
        sync = self.replicated.sync if self.replicated is not None else self.session_sync
        if sync is None and (keeps or pushes):
            replica = self.shared_load.replica if self.shared_load is not None else replica_id()
            sync = self.session_sync = DecisionSync(
                None, redis, self.config.index.replicated, replica, known=self._serves
            )
            self._spawn(sync.start(catch_up_timeout=max(redis.admin_timeout, 1.0)))
            self.metrics.state.sources.session_sync = sync
        if pushes and sync is not None and self.shared_load is not None and sync.load is None:
            sync.load = self.shared_load
            self.shared_load.on_change = sync.wake
            self.loads.on_change = self.shared_load.changed
        if not keeps:  # (no longer) a policy with sessions
            if sync is not None:
                sync.sessions = None
            if self.session_sync is not None and not pushes:
                self.session_sync.halt()  # nothing left to publish that anyone reads
                self.session_sync = None
                self.metrics.state.sources.session_sync = None
            return
        assert sync is not None and isinstance(sessions, SessionMap)
        sessions.on_note = sync.publish_session
        sync.sessions = sessions
        self.metrics.state.sources.session_sync = sync

    def _serves(self, key: EngineKey) -> bool:
        """Whether ``key`` (an endpoint and its DP rank) is an engine of this fleet."""
        engine = self.registry.engine_of(key)
        return engine is not None and key in engine.keys

    def _stream_states(self) -> list[tuple[StreamState, int | None]]:
        subscriber = self.subscriber
        if subscriber is None:
            return []
        return [(s, subscriber.digest_of(s.engine)) for s in subscriber.states()]

    async def stop(self) -> None:
        self.begin_drain()
        if self.snapshots is not None:
            # First, while every stream is still followed: a writer stopped later would
            # see none.
            await self.snapshots.stop()
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
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._bound is not None:
            self._bound.close()  # never served if start failed after binding
            self._bound = None
        if self.monitor is not None:
            await self.monitor.stop()
        await self.tokenizers.stop()
        if self.subscriber is not None:
            await self.subscriber.close()
        if self.upstream is not None:
            await self.upstream.close()
        if self.shared_load is not None:
            # No change may follow the withdrawal on the stream (peers would count this
            # replica again until their next exchange).
            self.shared_load.on_change = None
            for sync in (self.session_sync, self.replicated.sync if self.replicated else None):
                if sync is not None:
                    sync.load = None
            await self.shared_load.stop()
        if self.session_sync is not None:
            await self.session_sync.stop()
        if self.remote is not None and self._on_index_availability in self.remote.listeners:
            self.remote.listeners.remove(self._on_index_availability)
        if self.event_writer is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                # Write what the subscriber applied last, then stop writing.
                await asyncio.wait_for(self.event_writer.drain(), EVENT_WRITE_TIMEOUT_S)
            await self.event_writer.close()
        await self.index.close()
        if self.flow is not None:
            await self.flow.close()
        if self._tracer_provider is not None:
            self._tracer_provider.shutdown()  # flushes spans not exported yet
