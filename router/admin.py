"""Run-time administration of the engines: one layer behind the HTTP and gRPC admin APIs.

``GET /admin/engines`` and gRPC ``kvroute.v1.Admin/ListEngines`` show the same view;
adding, removing, draining and undraining an engine go through the same functions.
Errors are :class:`AdminError` with the HTTP status each front end maps to its own form
(OpenAI error JSON; gRPC status codes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pydantic import ValidationError

from router.config import EngineConfig
from router.engines.registry import Engine, EngineState
from router.security import AuthError, engine_allowed

if TYPE_CHECKING:
    from router.app import RouterApp


class AdminError(Exception):
    """A refused admin call: ``status`` is 400 (bad input), 401/403 or 404 (no such engine)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def authorize(app: RouterApp, credential: str | None, peer: str | None, api: str) -> None:
    """Every admin call passes here first, with the caller's ``Authorization`` value (HTTP
    header or gRPC metadata) and address, before anything is read or changed: an admin
    key (401 without one, 403 for a client key), or, with no admin keys configured, a
    caller on loopback (403 otherwise)."""
    try:
        app.credentials.check_admin(credential, peer)
    except AuthError as exc:
        app.metrics.auth_refusals.labels(api, "admin", str(exc.status)).inc()
        raise AdminError(exc.status, exc.message) from None


def endpoint_key(text: str) -> str:
    """``host:port`` from ``host:port`` or an engine URL (what admin paths take)."""
    text = text.strip()
    if "://" in text:
        parts = urlsplit(text)
        if parts.hostname and parts.port:
            return f"{parts.hostname}:{parts.port}"
    return text


def find(app: RouterApp, endpoint: str) -> Engine:
    engine = app.registry.get(endpoint_key(endpoint))
    if engine is None:
        known = ", ".join(sorted(e.endpoint for e in app.registry)) or "none"
        raise AdminError(404, f"no engine {endpoint!r}; known engines: {known}")
    return engine


async def engines(app: RouterApp) -> list[dict[str, Any]]:
    """Every engine: identity, state, models, per-rank load and index share."""
    try:
        held = await app.index.held_blocks()
    except Exception:  # an index that cannot answer now: show the rest
        held = None
    total = sum(held.values()) if held is not None else 0
    view = app.loads.view
    out = []
    for engine in sorted(app.registry, key=lambda e: e.endpoint):
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
                "ranks": ranks,
            }
        )
    return out


def _share(blocks: int | None, total: int) -> float | None:
    """An engine's blocks as a share of all engines' blocks (0 when the index is empty)."""
    if blocks is None:
        return None
    return blocks / total if total else 0.0


async def describe(app: RouterApp, engine: Engine) -> dict[str, Any]:
    """One engine as :func:`engines` shows it."""
    for entry in await engines(app):
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
        "ranks": [],
    }


def _config_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "engine"
        parts.append(f"{where}: {err['msg']}")
    return "invalid engine: " + "; ".join(parts)


async def add_engine(app: RouterApp, entry: Any) -> dict[str, Any]:
    """Register an engine described like an ``engines[]`` configuration entry."""
    if not isinstance(entry, Mapping):
        raise AdminError(400, "an engine is a JSON object like an engines[] entry")
    try:
        cfg = EngineConfig.model_validate(dict(entry))
    except ValidationError as exc:
        raise AdminError(400, _config_error(exc)) from None
    refused = await engine_allowed(cfg.url, app.config.auth.engine_cidrs)
    if refused is not None:
        raise AdminError(403, f"engine {cfg.url} refused: {refused}")
    engine = app.add_engine(cfg)
    return await describe(app, engine)


async def remove_engine(app: RouterApp, endpoint: str) -> dict[str, Any]:
    engine = find(app, endpoint)
    await app.remove_engine(engine.endpoint)
    return await describe(app, engine)


async def drain(app: RouterApp, endpoint: str) -> dict[str, Any]:
    """No new requests to the engine; in-flight ones finish."""
    engine = find(app, endpoint)
    if engine.state is EngineState.REFUSED:
        raise AdminError(400, f"engine {engine.endpoint} is refused: {engine.refused_reason}")
    app.registry.drain(engine)
    return await describe(app, engine)


async def reload(app: RouterApp) -> dict[str, Any]:
    """Re-read the configuration and key files (as SIGHUP does)."""
    if app.reloader is None:
        raise AdminError(400, "this router was not started from a configuration (kvroute serve)")
    result = await app.reloader.reload()
    if result is None:
        raise AdminError(
            400, "the new configuration is invalid; the running one stays (see the log)"
        )
    return {"applied": sorted(result.applied), "restart": sorted(result.restart)}


async def undrain(app: RouterApp, endpoint: str) -> dict[str, Any]:
    """Take new requests again (health checks may still eject it)."""
    engine = find(app, endpoint)
    app.registry.undrain(engine)
    return await describe(app, engine)
