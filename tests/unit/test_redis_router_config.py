"""How the configuration sets up a router on Redis (nothing here talks to Redis)."""

from __future__ import annotations

import pytest

from router.app import RouterApp, build_index
from router.config import ConfigError, load_config
from router.index import MemoryIndex
from router.index.shadow import ShadowedIndex
from router.types import EngineKey

REDIS = {"backend": "redis", "redis": {"url": "redis://127.0.0.1:1/0", "namespace": "cfg"}}


def config(**sections):
    return load_config(overrides=sections, environ={})


async def test_the_redis_backend_gives_a_router_a_shadowed_index_as_configured() -> None:
    index = build_index(config(index={**REDIS, "shadow_window_s": 5, "shadow_max_keys": 123}))
    try:
        assert isinstance(index, ShadowedIndex)
        assert (index.shadow.window, index.shadow.max_keys) == (5, 123)
        assert index.remote.redis.namespace == "cfg"
    finally:
        await index.close()
    assert isinstance(build_index(config()), MemoryIndex)


def test_routers_fed_by_an_indexer_need_the_redis_backend() -> None:
    with pytest.raises(ConfigError, match=r"via_indexer needs index\.backend: redis"):
        config(events={"via_indexer": True})


def test_published_load_must_outlive_the_exchange_interval() -> None:
    with pytest.raises(ConfigError, match="load_ttl_s must be longer"):
        config(index={"redis": {"load_interval_s": 0.5, "load_ttl_s": 0.5}})


async def test_routers_fed_by_an_indexer_treat_their_engines_as_publishing_events() -> None:
    engines = [
        {"url": "http://10.0.0.1:8000"},
        {"url": "http://10.0.0.2:8000", "kv_events": "none"},
    ]
    app = RouterApp(config(index=REDIS, events={"via_indexer": True}, engines=engines))
    try:
        assert app.core.has_events(EngineKey("10.0.0.1:8000"))
        assert not app.core.has_events(EngineKey("10.0.0.2:8000"))
        assert not app.subscribes and app.event_writer is None
        assert app.shadowed is app.index
    finally:
        await app.index.close()
