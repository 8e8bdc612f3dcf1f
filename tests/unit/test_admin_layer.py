"""The admin layer over the pieces it uses (no router around it): a registry, an index,
loads, credentials, the live configuration and the fleet's add/remove."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter

from router.admin import Admin, AdminError
from router.config import AuthConfig, Config, EngineConfig, HealthConfig
from router.fleet.load import LoadTracker
from router.fleet.registry import Engine, Registry
from router.index.memory import MemoryIndex
from router.live_config import LiveConfig
from router.security import Credentials
from router.types import EngineKey


def _admin(
    registry: Registry,
    index: MemoryIndex,
    config: Config | None = None,
    metrics: CollectorRegistry | None = None,
) -> Admin:
    config = config or Config()
    metrics = metrics or CollectorRegistry()
    refusals = Counter("refusals", "", ["api", "kind", "status"], registry=metrics)

    async def remove(endpoint: str) -> Engine | None:
        return registry.remove(endpoint)

    return Admin(
        registry=registry,
        index=index,
        loads=LoadTracker(16),
        credentials=Credentials(config.auth),
        live=LiveConfig(config),
        auth_refusals=refusals,
        add_engine=lambda cfg: registry.add(Engine.from_config(cfg)),
        remove_engine=remove,
        reloader=lambda: None,
    )


async def test_engines_show_each_engines_share_of_the_index() -> None:
    registry = Registry(HealthConfig())
    for port in (9001, 9002):
        registry.add(Engine.from_config(EngineConfig(url=f"http://127.0.0.1:{port}")))
    index = MemoryIndex()
    await index.add(EngineKey("127.0.0.1:9001", 0), [1, 2, 3])
    await index.add(EngineKey("127.0.0.1:9002", 0), [1])
    entries = await _admin(registry, index).engines()
    assert [(e["endpoint"], e["index_blocks"], e["index_share"]) for e in entries] == [
        ("127.0.0.1:9001", 3, 0.75),
        ("127.0.0.1:9002", 1, 0.25),
    ]


async def test_an_unknown_engine_is_a_404_naming_the_known_ones() -> None:
    registry = Registry(HealthConfig())
    registry.add(Engine.from_config(EngineConfig(url="http://127.0.0.1:9001")))
    with pytest.raises(AdminError) as err:
        await _admin(registry, MemoryIndex()).drain("127.0.0.1:9999")
    assert err.value.status == 404 and "127.0.0.1:9001" in err.value.message


async def test_adding_an_engine_outside_the_allowed_networks_is_refused() -> None:
    config = Config(auth=AuthConfig(engine_cidrs=["10.0.0.0/8"]))
    registry = Registry(HealthConfig())
    with pytest.raises(AdminError) as err:
        await _admin(registry, MemoryIndex(), config).add_engine({"url": "http://127.0.0.1:9001"})
    assert err.value.status == 403 and len(registry) == 0


def test_admin_calls_from_afar_need_an_admin_key_and_are_counted() -> None:
    metrics = CollectorRegistry()
    admin = _admin(Registry(HealthConfig()), MemoryIndex(), metrics=metrics)
    with pytest.raises(AdminError) as err:
        admin.authorize(None, "203.0.113.7", "http")
    assert err.value.status == 403
    labels = {"api": "http", "kind": "admin", "status": "403"}
    assert metrics.get_sample_value("refusals_total", labels) == 1
    admin.authorize(None, "127.0.0.1", "http")  # loopback, no admin keys configured


async def test_reload_without_a_reloader_says_why() -> None:
    with pytest.raises(AdminError, match="not started from a configuration"):
        await _admin(Registry(HealthConfig()), MemoryIndex()).reload()
