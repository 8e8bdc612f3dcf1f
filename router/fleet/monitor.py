"""Background work on engines: health probes, metrics scrapes, discovery.

None of this runs on the request path. Discovery reads an engine's ``/v1/models`` and,
when it offers one, ``/server_info`` (the emulator reports its KV-event endpoints and
block size there, so ``kvroute serve --engine URL`` needs no further flags); it runs
with an engine's first passing health probe (at start-up, or whenever an engine that
was not up then first answers).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import msgspec

from router.config import Config, EventEndpoints
from router.fleet.load import LoadTracker
from router.fleet.registry import Engine, EngineState, Registry
from router.fleet.scrape import parse_metrics
from router.proxy import Upstream, UpstreamError
from router.security import endpoint_allowed

log = logging.getLogger("kvroute.engines")
_decode = msgspec.json.decode


def _reachable(endpoint: str, engine_host: str) -> str:
    """An endpoint an engine reported with a wildcard host, made connectable."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host_port = endpoint[len("tcp://") :]
    host, _, port = host_port.rpartition(":")
    if host in ("*", "0.0.0.0", "::", "[::]", ""):
        host = engine_host
    return f"tcp://{host}:{port}"


class EngineMonitor:
    """Probes, scrapes and discovers engines on timers."""

    def __init__(
        self,
        config: Config,
        registry: Registry,
        upstream: Upstream,
        loads: LoadTracker,
        on_discovered: Callable[[Engine], Awaitable[None]],
        on_block_size: Callable[[Engine], Awaitable[None]],
    ) -> None:
        self.config = config
        self.registry = registry
        self.upstream = upstream
        self.loads = loads
        self.on_discovered = on_discovered
        self.on_block_size = on_block_size
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Probe (and so discover) every engine once, then keep doing it on timers."""
        await asyncio.gather(*(self.probe(e) for e in self.registry), return_exceptions=True)
        self._tasks = [
            asyncio.ensure_future(self._every(self.config.health.interval_s, self.probe_all)),
            asyncio.ensure_future(self._every(self.config.scrape.interval_s, self.scrape_all)),
            asyncio.ensure_future(
                self._every(self.config.health.models_refresh_s, self.refresh_models)
            ),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _every(self, interval: float, job: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await job()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("background engine job failed")

    # ------------------------------------------------------------------ discovery

    async def discover(self, engine: Engine) -> bool:
        """Learn models, block size and KV-event endpoints; False if unreachable."""
        timeout = self.config.health.timeout_s * 2
        try:
            status, body = await self.upstream.get(engine.url + "/v1/models", timeout)
        except UpstreamError as exc:
            log.warning("engine %s not reachable yet: %s", engine.url, exc)
            return False
        if status == 200 and not engine.models_configured:
            self._apply_models(engine, body)
        try:
            status, body = await self.upstream.get(engine.url + "/server_info", timeout)
            info = _decode(body) if status == 200 else {}
        except (UpstreamError, msgspec.DecodeError):
            info = {}
        reported = engine.events is None  # not configured: whatever it reports is checked
        if isinstance(info, dict):
            self._apply_server_info(engine, info)
        if engine.block_size is None:
            await self._read_block_size(engine, timeout)
        refused = engine.state is EngineState.REFUSED
        if engine.events is None and engine.wants_events and not refused:
            await self._read_event_sources(engine, timeout)
        if engine.state is EngineState.REFUSED:  # it announced too many ranks
            engine.discovered = True  # refused once, not at every probe
            return True
        if engine.events is None and engine.wants_events and self.config.events.port:
            self._apply_port_convention(engine)
        if reported and engine.events is not None:
            await self._check_reported_events(engine)
        engine.discovered = True
        engine.refresh()
        self.registry.changed()
        await self.on_discovered(engine)
        return True

    def _apply_models(self, engine: Engine, body: bytes) -> None:
        try:
            cards = [c for c in _decode(body).get("data", []) if isinstance(c, dict) and "id" in c]
        except (msgspec.DecodeError, AttributeError, TypeError):
            log.warning("engine %s answered /v1/models with something else", engine.url)
            return
        models = {str(c["id"]) for c in cards}
        parents = {str(c["id"]): str(c["parent"]) for c in cards if c.get("parent")}
        if models != engine.models or parents != engine.parents:
            added, gone = models - engine.models, engine.models - models
            if engine.discovered and (added or gone):
                log.info(
                    "engine %s now serves %s (added %s, gone %s)",
                    engine.url,
                    sorted(models),
                    sorted(added),
                    sorted(gone),
                )
            engine.models, engine.parents = models, parents
            self.registry.changed()

    async def refresh_models(self) -> None:
        """Re-read /v1/models of discovered engines: LoRA adapters come and go."""
        for engine in self.registry:
            if engine.models_configured or not engine.discovered:
                continue
            if engine.state is not EngineState.HEALTHY:
                continue
            try:
                status, body = await self.upstream.get(
                    engine.url + "/v1/models", self.config.health.timeout_s
                )
            except UpstreamError:
                continue
            if status == 200:
                self._apply_models(engine, body)

    def _apply_server_info(self, engine: Engine, info: dict[str, object]) -> None:
        block_size = info.get("block_size")
        if isinstance(block_size, int):
            engine.block_size = block_size
        bootstrap = info.get("bootstrap_port")
        if engine.bootstrap_port is None and isinstance(bootstrap, int) and bootstrap > 0:
            engine.bootstrap_port = bootstrap
        dp = info.get("dp_size")
        if isinstance(dp, int) and dp >= 1:
            if self._too_many_ranks(engine, dp, "/server_info dp_size"):
                return
            engine.dp_size = dp
        pub = info.get("kv_events_endpoint")
        if engine.events is None and engine.wants_events and isinstance(pub, str) and pub:
            host = urlsplit(engine.url).hostname or "127.0.0.1"
            replay = info.get("kv_events_replay_endpoint")
            topic = info.get("kv_events_topic")
            engine.events = EventEndpoints(
                endpoint=_reachable(pub, host),
                replay_endpoint=_reachable(replay, host)
                if isinstance(replay, str) and replay
                else None,
                topic=topic if isinstance(topic, str) else "",
            )
            ranks = info.get("ranks")
            for entry in ranks if isinstance(ranks, list) else []:
                if not isinstance(entry, dict) or not isinstance(entry.get("rank"), int):
                    continue
                rank_pub = entry.get("kv_events_endpoint")
                rank_replay = entry.get("kv_events_replay_endpoint")
                if isinstance(rank_pub, str) and rank_pub:
                    engine.rank_events[entry["rank"]] = EventEndpoints(
                        endpoint=_reachable(rank_pub, host),
                        replay_endpoint=_reachable(rank_replay, host)
                        if isinstance(rank_replay, str) and rank_replay
                        else None,
                        topic=engine.events.topic,
                    )

    async def _read_block_size(self, engine: Engine, timeout: float) -> None:
        """The block size from ``vllm:cache_config_info`` (or SGLang's page size), so that
        a pool without a configured block size adopts its engines' before it routes."""
        try:
            status, body = await self.upstream.get(engine.url + "/metrics", timeout)
        except UpstreamError:
            return
        if status == 200:
            scrape = parse_metrics(body.decode("utf-8", "replace"))
            engine.block_size = scrape.block_size
            engine.sglang = scrape.sglang

    async def _read_event_sources(self, engine: Engine, timeout: float) -> None:
        """vLLM 0.32's ``GET /kv_event_sources``: ``{"<dp rank>": {"endpoint",
        "replay_endpoint", "topic", ...}}`` (no dev mode needed)."""
        try:
            status, body = await self.upstream.get(engine.url + "/kv_event_sources", timeout)
            sources = _decode(body) if status == 200 else {}
        except (UpstreamError, msgspec.DecodeError):
            return
        if not isinstance(sources, dict):
            return
        host = urlsplit(engine.url).hostname or "127.0.0.1"
        ranks: dict[int, EventEndpoints] = {}
        for rank, entry in sources.items():
            if not isinstance(entry, dict) or not str(rank).isdigit():
                continue
            if entry.get("enable_kv_cache_events") is False or entry.get("publisher") not in (
                None,
                "zmq",
            ):
                continue
            pub, replay, topic = (
                entry.get("endpoint"),
                entry.get("replay_endpoint"),
                entry.get("topic"),
            )
            if not isinstance(pub, str) or not pub:
                continue
            ranks[int(rank)] = EventEndpoints(
                endpoint=_reachable(pub, host),
                replay_endpoint=_reachable(replay, host)
                if isinstance(replay, str) and replay
                else None,
                topic=topic if isinstance(topic, str) else "",
            )
        if 0 not in ranks or self._too_many_ranks(engine, len(ranks), "/kv_event_sources"):
            return
        engine.events = ranks[0]
        engine.rank_events.update({r: e for r, e in ranks.items() if r != 0})
        if len(ranks) > engine.dp_size:
            engine.dp_size = len(ranks)
        log.info("engine %s publishes KV events at %s", engine.url, engine.events.endpoint)

    def _too_many_ranks(self, engine: Engine, announced: int, source: str) -> bool:
        """Refuse an engine announcing more data-parallel ranks than
        ``limits.max_dp_size`` (each is a routing target with its own load and index
        entries); True if refused."""
        limit = self.config.limits.max_dp_size
        if announced <= limit:
            return False
        reason = (
            f"engine {engine.url} announces {announced} data-parallel ranks ({source}), more "
            f"than limits.max_dp_size {limit}; raise the limit if it really has them"
        )
        log.error("refusing %s", reason)
        self.registry.refuse(engine, reason)
        return True

    def _apply_port_convention(self, engine: Engine) -> None:
        host = urlsplit(engine.url).hostname or "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        replay_port = self.config.events.replay_port
        engine.events = EventEndpoints(
            endpoint=f"tcp://{host}:{self.config.events.port}",
            replay_endpoint=f"tcp://{host}:{replay_port}" if replay_port else None,
        )

    async def _check_reported_events(self, engine: Engine) -> None:
        """Forget KV-event endpoints the engine reported off its own host and outside
        ``auth.engine_cidrs``: the router would connect there. It is then routed from
        decisions, like an engine without events."""
        own = urlsplit(engine.url).hostname
        cidrs = self.config.auth.engine_cidrs
        for endpoints in (engine.events, *engine.rank_events.values()):
            if endpoints is None:
                continue
            for endpoint in (endpoints.endpoint, endpoints.replay_endpoint):
                if endpoint is None:
                    continue
                refused = await endpoint_allowed(endpoint, cidrs, own_host=own)
                if refused is not None:
                    log.warning(
                        "engine %s reports KV events at %s, not followed: %s",
                        engine.url,
                        endpoint,
                        refused,
                    )
                    engine.events = None
                    engine.rank_events.clear()
                    return

    # ------------------------------------------------------------------ health

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(e) for e in self.registry))

    async def probe(self, engine: Engine) -> None:
        """GET /health; the first passing probe discovers the engine and admits it."""
        try:
            status, _ = await self.upstream.get(
                engine.url + "/health", self.config.health.timeout_s
            )
            problem = "" if status == 200 else f"answered {status}"
        except UpstreamError as exc:
            problem = str(exc)
        if problem:
            self.registry.record_failure(engine)
            if engine.state is EngineState.PENDING and engine.failures == 1:
                log.warning("engine %s not ready yet: /health %s", engine.url, problem)
            return
        if not engine.discovered:
            await self.discover(engine)
        if engine.state is EngineState.REFUSED:
            return
        self.registry.probe_succeeded(engine)

    # ------------------------------------------------------------------ load

    async def scrape_all(self) -> None:
        engines = [e for e in self.registry if e.state is not EngineState.EJECTED]
        await asyncio.gather(*(self.scrape(e) for e in engines))

    async def scrape(self, engine: Engine) -> None:
        try:
            status, body = await self.upstream.get(
                engine.url + "/metrics", self.config.scrape.timeout_s
            )
        except UpstreamError:
            return
        if status != 200:
            return
        scrape = parse_metrics(body.decode("utf-8", "replace"))
        engine.sglang = scrape.sglang
        now = time.monotonic()
        for key in engine.keys:
            sample = scrape.ranks.get(key.rank)
            if sample is not None:
                self.loads.report(key, now, sample.waiting, sample.running, sample.kv_usage)
        if scrape.block_size is not None and engine.block_size != scrape.block_size:
            engine.block_size = scrape.block_size
            await self.on_block_size(engine)
