"""Run-time administration of the engines: one layer behind the HTTP and gRPC admin APIs.

``GET /admin/engines`` and gRPC ``kvroute.v1.Admin/ListEngines`` show the same view;
adding, removing, draining and undraining an engine go through the same :class:`Admin`.
Errors are :class:`AdminError` with the HTTP status each front end maps to its own form
(OpenAI error JSON; gRPC status codes).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pydantic import ValidationError

from router.config import EngineConfig
from router.fleet.registry import Engine, EngineState
from router.security import AuthError, engine_refused

if TYPE_CHECKING:
    from prometheus_client import Counter

    from router.fleet.load import LoadTracker
    from router.fleet.registry import Registry
    from router.index.base import KVIndex
    from router.live_config import LiveConfig
    from router.reload import Reloader
    from router.security import Credentials
    from router.tokenization.pools import Tokenizers


class AdminError(Exception):
    """A refused admin call: ``status`` is 400 (bad input), 401/403 or 404 (no such engine)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def endpoint_key(text: str) -> str:
    """``host:port`` from ``host:port`` or an engine URL (what admin paths take)."""
    text = text.strip()
    if "://" in text:
        parts = urlsplit(text)
        if parts.hostname and parts.port:
            return f"{parts.hostname}:{parts.port}"
    return text


class Admin:
    """The admin operations, over the pieces of a router they read and change."""

    def __init__(
        self,
        *,
        registry: Registry,
        index: KVIndex,
        loads: LoadTracker,
        credentials: Credentials,
        live: LiveConfig,
        auth_refusals: Counter,
        add_engine: Callable[[EngineConfig], Engine],
        remove_engine: Callable[[str], Awaitable[Engine | None]],
        reloader: Callable[[], Reloader | None],
        tokenizers: Tokenizers | None = None,
    ) -> None:
        """``add_engine``/``remove_engine`` change the fleet (the router's own, which also
        probes, follows KV events and clears index entries); ``reloader`` is the router's
        reloader, if it was started from a configuration (``kvroute serve``);
        ``tokenizers``, the pools' tokenizers the engine list shows beside the engines."""
        self.registry = registry
        self.index = index
        self.loads = loads
        self.credentials = credentials
        self.live = live
        self.auth_refusals = auth_refusals
        self._add_engine = add_engine
        self._remove_engine = remove_engine
        self._reloader = reloader
        self._tokenizers = tokenizers

    def authorize(self, credential: str | None, peer: str | None, api: str) -> None:
        """Every admin call passes here first, with the caller's ``Authorization`` value
        (HTTP header or gRPC metadata) and address, before anything is read or changed:
        an admin key (401 without one, 403 for a client key), or, with no admin keys
        configured, a caller on loopback (403 otherwise)."""
        try:
            self.credentials.check_admin(credential, peer)
        except AuthError as exc:
            self.auth_refusals.labels(api, "admin", str(exc.status)).inc()
            raise AdminError(exc.status, exc.message) from None

    def find(self, endpoint: str) -> Engine:
        engine = self.registry.get(endpoint_key(endpoint))
        if engine is None:
            known = ", ".join(sorted(e.endpoint for e in self.registry)) or "none"
            raise AdminError(404, f"no engine {endpoint!r}; known engines: {known}")
        return engine

    async def engines(self) -> list[dict[str, Any]]:
        """Every engine: identity, state, models, per-rank load and index share."""
        try:
            held = await self.index.held_blocks()
        except Exception:  # an index that cannot answer now: show the rest
            held = None
        total = sum(held.values()) if held is not None else 0
        view = self.loads.view
        out = []
        for engine in sorted(self.registry, key=lambda e: e.endpoint):
            ranks = []
            for key in engine.keys:
                load = view.get(key)
                blocks = held.get(key, 0) if held is not None else None
                ranks.append(
                    {
                        "rank": key.rank,
                        "inflight_requests": load.requests if load else 0,
                        "queued_prefill_tokens": load.prefill_tokens if load else 0,
                        "decode_blocks": load.decode_blocks if load else 0,
                        "decoding": load.decoding if load else 0,
                        "latency": load.latency.as_dict() if load and load.latency else None,
                        "offered_prefill_tokens_per_s": (
                            load.offered_tokens_per_s(time.monotonic()) if load else 0.0
                        ),
                        "index_blocks": blocks,
                        "index_share": _share(blocks, total),
                    }
                )
            blocks_sum = sum(r["index_blocks"] for r in ranks) if held is not None else None
            out.append(
                {
                    "endpoint": engine.endpoint,
                    "url": engine.url,
                    "role": engine.role,
                    "state": engine.state.value,
                    "models": sorted(engine.models),
                    "dp_size": engine.dp_size,
                    "inflight_requests": sum(r["inflight_requests"] for r in ranks),
                    "index_blocks": blocks_sum,
                    "index_share": _share(blocks_sum, total),
                    "refused_reason": engine.refused_reason,
                    "discovered": engine.discovered,
                    "topology": _topology(engine),
                    "ranks": ranks,
                }
            )
        return out

    def tokenizers(self) -> list[dict[str, Any]]:
        """Each model pool's tokenizer: mode, the path it is on and why."""
        return self._tokenizers.describe() if self._tokenizers is not None else []

    async def describe(self, engine: Engine) -> dict[str, Any]:
        """One engine as :meth:`engines` shows it."""
        for entry in await self.engines():
            if entry["endpoint"] == engine.endpoint:
                return entry
        # Removed engines are no longer listed: show what is left of them.
        return {
            "endpoint": engine.endpoint,
            "url": engine.url,
            "role": engine.role,
            "state": "removed",
            "models": sorted(engine.models),
            "dp_size": engine.dp_size,
            "inflight_requests": 0,
            "index_blocks": None,
            "index_share": None,
            "refused_reason": engine.refused_reason,
            "discovered": engine.discovered,
            "topology": _topology(engine),
            "ranks": [],
        }

    async def add_engine(self, entry: Any) -> dict[str, Any]:
        """Register an engine described like an ``engines[]`` configuration entry."""
        if not isinstance(entry, Mapping):
            raise AdminError(400, "an engine is a JSON object like an engines[] entry")
        try:
            cfg = EngineConfig.model_validate(dict(entry))
        except ValidationError as exc:
            raise AdminError(400, _config_error(exc)) from None
        refused = await engine_refused(cfg, self.live.current.auth.engine_cidrs)
        if refused is not None:
            raise AdminError(403, f"engine {cfg.url} refused: {refused}")
        engine = self._add_engine(cfg)
        return await self.describe(engine)

    async def remove_engine(self, endpoint: str) -> dict[str, Any]:
        engine = self.find(endpoint)
        await self._remove_engine(engine.endpoint)
        return await self.describe(engine)

    async def drain(self, endpoint: str) -> dict[str, Any]:
        """No new requests to the engine; in-flight ones finish."""
        engine = self.find(endpoint)
        if engine.state is EngineState.REFUSED:
            raise AdminError(400, f"engine {engine.endpoint} is refused: {engine.refused_reason}")
        self.registry.drain(engine)
        return await self.describe(engine)

    async def undrain(self, endpoint: str) -> dict[str, Any]:
        """Take new requests again (health checks may still eject it)."""
        engine = self.find(endpoint)
        self.registry.undrain(engine)
        return await self.describe(engine)

    async def reload(self) -> dict[str, Any]:
        """Re-read the configuration and key files (as SIGHUP does)."""
        reloader = self._reloader()
        if reloader is None:
            raise AdminError(
                400, "this router was not started from a configuration (kvroute serve)"
            )
        result = await reloader.reload()
        if result is None:
            raise AdminError(
                400, "the new configuration is invalid; the running one stays (see the log)"
            )
        return {"applied": sorted(result.applied), "restart": sorted(result.restart)}


def _topology(engine: Engine) -> dict[str, str | None] | None:
    """Where the engine runs, as ``engines[].topology`` says it (None: not known)."""
    where = engine.topology
    if where is None:
        return None
    return {"node": where.node, "rack": where.rack, "zone": where.zone}


def _share(blocks: int | None, total: int) -> float | None:
    """An engine's blocks as a share of all engines' blocks (0 when the index is empty)."""
    if blocks is None:
        return None
    return blocks / total if total else 0.0


def _config_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "engine"
        parts.append(f"{where}: {err['msg']}")
    return "invalid engine: " + "; ".join(parts)
