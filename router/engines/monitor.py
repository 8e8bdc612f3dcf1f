"""Background work on engines: health probes, metrics scrapes, discovery.

None of this runs on the request path. Discovery reads an engine's ``/v1/models`` and,
when it offers one, ``/server_info`` (the emulator reports its KV-event endpoints and
block size there, so ``kvroute serve --engine URL`` needs no further flags); it runs
at start-up and again whenever an engine that was never discovered becomes healthy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import msgspec

from router.config import Config, EventEndpoints
from router.engines.load import LoadTracker
from router.engines.registry import Engine, EngineState, Registry
from router.engines.scrape import parse_metrics
from router.proxy import Upstream, UpstreamError

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
        await asyncio.gather(*(self.discover(e) for e in self.registry), return_exceptions=True)
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
        if isinstance(info, dict):
            self._apply_server_info(engine, info)
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

    # ------------------------------------------------------------------ health

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(e) for e in self.registry))

    async def probe(self, engine: Engine) -> None:
        try:
            status, _ = await self.upstream.get(
                engine.url + "/health", self.config.health.timeout_s
            )
            ok = status == 200
        except UpstreamError:
            ok = False
        if not ok:
            if self.registry.record_failure(engine):
                log.warning("engine %s ejected after %d failures", engine.url, engine.failures)
            return
        if not engine.discovered:
            await self.discover(engine)
        if engine.state is EngineState.REFUSED:
            return
        if self.registry.probe_succeeded(engine):
            log.info("engine %s re-admitted", engine.url)

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
        now = time.monotonic()
        for key in engine.keys:
            sample = scrape.ranks.get(key.rank)
            if sample is not None:
                self.loads.report(key, now, sample.waiting, sample.running, sample.kv_usage)
        if scrape.block_size is not None and engine.block_size != scrape.block_size:
            engine.block_size = scrape.block_size
            await self.on_block_size(engine)
