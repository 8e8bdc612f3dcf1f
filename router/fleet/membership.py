"""The engines the router routes to as they come and go.

Engines join from the configuration, the admin API (``/admin/engines``, gRPC ``Admin``),
Kubernetes discovery (:mod:`router.fleet.k8s`) and a reload of the static ``engines``
list. A new engine is probed in the background; its discovery (what it serves, its block
size, where its KV events are) admits it once its block size fits its pools, then its
KV events are followed and its models' tokenizers settled. An engine back from an
ejection may have restarted: its event streams resync. An engine that goes takes its
event streams, its index entries and the routing core's state of it along.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from router.fleet.monitor import EngineMonitor
from router.fleet.registry import Engine, EngineState, endpoint_of
from router.index.base import IndexUnavailable

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from router.config import Config, EngineConfig
    from router.core import RoutingCore
    from router.events.follow import EventFollowing
    from router.fleet.block_size import BlockSizes
    from router.fleet.k8s import KubernetesDiscovery
    from router.fleet.load import LoadTracker
    from router.fleet.registry import Registry
    from router.index.base import KVIndex
    from router.live_config import LiveConfig
    from router.proxy import Upstream
    from router.tokenization import Tokenizers
    from router.types import EngineKey

log = logging.getLogger("kvroute")


class EngineFleet:
    """Adds, removals and discovery of engines while the router runs (what
    :class:`~router.fleet.k8s.KubernetesDiscovery` and the admin layer change)."""

    def __init__(
        self,
        live: LiveConfig,
        registry: Registry,
        index: KVIndex,
        loads: LoadTracker,
        core: RoutingCore,
        block_sizes: BlockSizes,
        events: EventFollowing,
        tokenizers: Tokenizers,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        """``spawn`` runs a background job owned by the router."""
        self.live = live
        self.registry = registry
        self.index = index
        self.loads = loads
        self.core = core
        self.block_sizes = block_sizes
        self.events = events
        self.tokenizers = tokenizers
        self.spawn = spawn
        self.monitor: EngineMonitor | None = None
        """The engine monitor, once started: it probes and discovers engines."""
        registry.listeners.append(self._state_changed)

    @property
    def config(self) -> Config:
        return self.live.current

    def monitored(self, upstream: Upstream) -> EngineMonitor:
        """The engine monitor of this fleet (probes, discovery, scrapes), to start."""
        self.monitor = EngineMonitor(
            self.config,
            self.registry,
            upstream,
            self.loads,
            self.discovered,
            self.block_size_reported,
        )
        return self.monitor

    def kubernetes(self, metrics: CollectorRegistry) -> KubernetesDiscovery | None:
        """Kubernetes discovery of engines from pods, to start, if
        ``discovery.kubernetes`` is on; its metrics are collected into ``metrics``."""
        if not self.config.discovery.kubernetes.enabled:
            return None
        from router.fleet.k8s import DiscoveryCollector, KubernetesDiscovery

        discovery = KubernetesDiscovery(self, self.config.discovery.kubernetes)
        metrics.register(DiscoveryCollector(discovery))
        return discovery

    def serves(self, key: EngineKey) -> bool:
        """Whether ``key`` (an endpoint and its DP rank) is an engine of this fleet."""
        engine = self.registry.engine_of(key)
        return engine is not None and key in engine.keys

    def add_engine(self, cfg: EngineConfig) -> Engine:
        """Register an engine while running (admin API, Kubernetes discovery).

        A first probe and discovery (models, block size, KV events) run in the
        background; the engine becomes a candidate once its probe passes. Adding a known
        URL replaces its settings.
        """
        engine = self.registry.add(Engine.from_config(cfg))
        if self.monitor is not None:
            self.spawn(self.monitor.probe(engine))
        return engine

    async def remove_engine(self, endpoint: str) -> Engine | None:
        """Forget an engine: no more routing, its KV-event streams and index entries go."""
        engine = self.registry.remove(endpoint)
        if engine is None:
            return None
        for key in engine.keys:
            await self.events.drop(key)
            with contextlib.suppress(IndexUnavailable):  # Redis down: entries age out
                await self.index.clear(key)
            self.core.forget(key)
        return engine

    async def apply_engines(self, new: Config, old: Config) -> None:
        """A reload's ``engines``: removed and changed engines go (with their index
        entries), new ones come."""
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

    def _state_changed(self, engine: Engine, previous: EngineState) -> None:
        if previous is EngineState.EJECTED and engine.state is EngineState.HEALTHY:
            # It was unreachable: it may have restarted with an empty cache.
            self.events.readmitted(engine)

    async def discovered(self, engine: Engine) -> None:
        """The monitor discovered an engine (after a passing probe): admit it if its
        block size fits, follow its KV events, settle its models' tokenizers."""
        if not await self.check_block_size(engine):
            return
        # Discovery follows a passing probe: admit the engine now that its block size
        # fits, before the tokenizer probe below, which needs a healthy engine.
        self.registry.probe_succeeded(engine)
        await self.events.subscribe(engine)
        for model in self.registry.base_models(engine):
            await self.tokenizers.resolve(model)

    async def block_size_reported(self, engine: Engine) -> None:
        """An engine reported its block size again (its metrics)."""
        await self.check_block_size(engine)

    async def check_block_size(self, engine: Engine) -> bool:
        """Refuse an engine whose block size differs from its pool's, and stop following
        its events; True if it fits."""
        if self.block_sizes.fits(engine):
            return True
        for key in engine.keys:
            await self.events.drop(key)
        return False
