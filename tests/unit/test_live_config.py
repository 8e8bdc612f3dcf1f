"""LiveConfig: the configuration in force and the subscribers of its sections."""

from __future__ import annotations

import pytest

from router.config import Config
from router.live_config import LiveConfig


def _with(config: Config, **sections: dict[str, object]) -> Config:
    tree = config.model_dump()
    for name, values in sections.items():
        tree[name].update(values)
    return Config.model_validate(tree)


async def test_only_the_subscribers_of_changed_sections_are_called_in_order() -> None:
    live = LiveConfig(Config())
    calls: list[tuple[str, float, float]] = []

    def core(new: Config, old: Config) -> None:
        calls.append(("core", new.policy.queue_weight, old.policy.queue_weight))

    async def proxy(new: Config, old: Config) -> None:
        calls.append(("proxy", new.proxy.retries, old.proxy.retries))

    live.subscribe("core", ("policy", "limits"), core)
    live.subscribe("proxy", ("proxy",), proxy)
    live.subscribe("both", ("policy", "proxy"), lambda new, old: calls.append(("both", 0, 0)))
    new = _with(live.current, policy={"queue_weight": 3.0})
    assert await live.publish(new) == ["core", "both"]
    assert calls == [("core", 3.0, 1.0), ("both", 0, 0)]
    calls.clear()
    assert await live.publish(_with(new, proxy={"retries": 3})) == ["proxy", "both"]
    assert calls == [("proxy", 3, 1), ("both", 0, 0)]


async def test_subscribers_see_the_new_configuration_as_current() -> None:
    live = LiveConfig(Config())
    seen: list[int] = []
    live.subscribe("reader", ("limits",), lambda new, old: seen.append(live.current.limits.max_n))
    await live.publish(_with(live.current, limits={"max_n": 9}))
    assert seen == [9] and live.current.limits.max_n == 9


async def test_publishing_an_equal_configuration_calls_nobody() -> None:
    live = LiveConfig(Config())
    live.subscribe("any", ("policy",), lambda new, old: pytest.fail("called"))
    assert await live.publish(Config()) == []


def test_a_subscription_names_real_sections() -> None:
    live = LiveConfig(Config())
    with pytest.raises(ValueError, match="polcy"):
        live.subscribe("typo", ("polcy",), lambda new, old: None)
    live.subscribe("a", ("health",), lambda new, old: None)
    live.subscribe("b", ("health", "scrape"), lambda new, old: None)
    assert live.subscribers("health") == ["a", "b"] and live.subscribers("scrape") == ["b"]
