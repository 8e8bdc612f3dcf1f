"""One running router: every component built from the configuration, started and stopped.

``kvroute serve`` runs one :class:`RouterApp` in one asyncio process. Tests run several
in one process (each has its own metrics registry, index and client session).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from router.api.admin_http import AdminHttp
from router.api.decide import Decider
from router.api.http import HttpApi, openai_errors
from router.api.picks import PickLedger
from router.config import Config, EngineConfig
from router.core import RoutingCore
from router.engines.load import LoadTracker
from router.engines.monitor import EngineMonitor
from router.engines.registry import Engine, EngineState, Registry
from router.events.ingest import EventIngestor
from router.events.subscriber import EventSource, KVEventSubscriber, parse_llmd_topic
from router.index import KVIndex, MemoryIndex
from router.index.base import IndexStats
from router.metrics import RouterMetrics, StateSources
from router.policy import make_policy
from router.proxy import Upstream, UpstreamError
from router.tokenization import Tokenizers, TokenizerUnavailable
from router.types import EngineKey

if TYPE_CHECKING:
    from router.grpc.server import GrpcServers

log = logging.getLogger("kvroute")


def build_index(config: Config) -> KVIndex:
    if config.index.backend == "memory":
        return MemoryIndex()
    raise NotImplementedError(f"index backend {config.index.backend!r} is not available")


class RouterApp:
    """The router's components and their lifecycle."""

    def __init__(self, config: Config, index: KVIndex | None = None) -> None:
        self.config = config
        self.tokenizers = Tokenizers(config, self._post_to_pool)
        self.index = index or build_index(config)
        self.loads = LoadTracker(config.block_size)
        self.registry = Registry(config.health)
        for engine_cfg in config.engines:
            self.registry.add(Engine.from_config(engine_cfg))
        self.registry.listeners.append(self._on_state_change)
        policy = make_policy(config.policy)
        self.core = RoutingCore(
            self.index, policy, config.policy, self.loads, has_events=self._has_events
        )
        self.decider = Decider(self)
        """Every API's decision path (HTTP, gRPC Pick and Generate, ext_proc)."""
        self.picks = PickLedger(self.loads, config.grpc.pick_ttl_s)
        """Load held by picks that gateways forward themselves (gRPC Pick, ext_proc)."""
        self.ingestor = EventIngestor(self.index, on_block_size_mismatch=self._block_size_mismatch)
        self.subscriber: KVEventSubscriber | None = None
        self._index_stats: IndexStats | None = None
        self.metrics = RouterMetrics(
            StateSources(
                core=self.core,
                registry=self.registry,
                ingest=self.ingestor.counters,
                index_stats=lambda: self._index_stats,
            )
        )
        self.metrics.state.sources.tokenizers = self.tokenizers
        self.metrics.watch_picks(self.picks)
        self._turn = 0
        self.draining = False
        self.drain_listeners: list[Callable[[], None]] = []
        """Called once when the router starts draining (health checks report not ready)."""
        self.started_at = time.time()
        self.upstream: Upstream | None = None
        self.monitor: EngineMonitor | None = None
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.url = ""
        self.grpc: GrpcServers | None = None
        self.grpc_port: int | None = None
        """The gRPC API's bound port (``grpc.port``), once started."""
        self.extproc_port: int | None = None
        """The Envoy ext_proc listener's bound port (``extproc.port``), once started."""

    # ------------------------------------------------------------------ wiring

    def _has_events(self, key: EngineKey) -> bool:
        if self.subscriber is None:
            return False
        return self.subscriber.stream_state(key) is not None

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

    def block_size_for(self, model: str) -> int:
        """The KV block size of a (base) model's pool."""
        return self.config.model_settings(model)[1]

    def _block_size_mismatch(self, key: EngineKey, expected: int, got: int) -> None:
        engine = self.registry.engine_of(key)
        if engine is not None and engine.state is not EngineState.REFUSED:
            engine.block_size = got
            self._spawn(self._check_block_size(engine))

    async def _check_block_size(self, engine: Engine) -> bool:
        """Refuse an engine whose block size differs from its pool's; True if it fits."""
        if engine.block_size is None:
            return True
        for model in self.registry.base_models(engine):
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
        engines = [e for e in self.registry if model in e.models and e.state is EngineState.HEALTHY]
        if not engines or self.upstream is None:
            raise TokenizerUnavailable(f"no healthy engine serves {model!r}")
        self._turn += 1
        engine = engines[self._turn % len(engines)]
        try:
            return await self.upstream.call(
                "POST", engine.url + path, body, self.config.health.timeout_s * 2
            )
        except UpstreamError as exc:
            raise TokenizerUnavailable(str(exc)) from None

    async def _on_discovered(self, engine: Engine) -> None:
        if not await self._check_block_size(engine):
            return
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
            await self.subscriber.add_source(
                EventSource(
                    engine=key,
                    namespace=bases[0],
                    endpoint=endpoints.endpoint,
                    replay_endpoint=endpoints.replay_endpoint,
                    topic=endpoints.topic,
                    block_size=self.block_size_for(bases[0]),
                )
            )
            log.info("following KV events of %s at %s", key.label, endpoints.endpoint)

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

        Discovery (models, block size, KV events) runs in the background; the engine
        becomes a candidate once it answers. Adding a known URL replaces its settings.
        """
        engine = self.registry.add(Engine.from_config(cfg))
        if self.monitor is not None:
            self._spawn(self.monitor.discover(engine))
        return engine

    async def remove_engine(self, endpoint: str) -> Engine | None:
        """Forget an engine: no more routing, its KV-event streams and index entries go."""
        engine = self.registry.remove(endpoint)
        if engine is None:
            return None
        for key in engine.keys:
            if self.subscriber is not None:
                await self.subscriber.remove_source(key, clear=True)
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

    # ------------------------------------------------------------------ lifecycle

    def web_app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.limits.max_body_bytes, middlewares=[openai_errors]
        )
        app.add_routes(HttpApi(self).routes())
        app.add_routes(AdminHttp(self).routes())
        return app

    async def start(self) -> str:
        """Start everything and listen; returns the bound URL."""
        self.upstream = Upstream(self.config.proxy)
        if self.config.events.enabled:
            self.subscriber = KVEventSubscriber(
                self.ingestor, replay_timeout=self.config.events.replay_timeout_s
            )
            self.metrics.state.sources.subscriber = self.subscriber.stats
            if self.config.events.bind_endpoint:
                bound = await self.subscriber.bind(
                    self.config.events.bind_endpoint, self._resolve_topic
                )
                log.info("KV events: bound %s for engines that connect", bound)
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
        self._tasks.append(asyncio.ensure_future(self._refresh_index_stats()))
        self._runner = web.AppRunner(self.web_app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, self.config.server.host, self.config.server.port, backlog=1024
        )
        await site.start()
        sockets = site._server.sockets if site._server else []  # type: ignore[union-attr]
        host, port = sockets[0].getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{port}"
        if self.config.grpc.port is not None or self.config.extproc.port is not None:
            from router.grpc.server import GrpcServers  # grpc loads only when asked for

            self.grpc = GrpcServers(self)
            await self.grpc.start()
        self.started_at = time.time()
        return self.url

    async def stop(self) -> None:
        self.begin_drain()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.grpc is not None:
            await self.grpc.stop()
            self.grpc = None
        self.picks.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.monitor is not None:
            await self.monitor.stop()
        if self.subscriber is not None:
            await self.subscriber.close()
        if self.upstream is not None:
            await self.upstream.close()
        await self.index.close()
