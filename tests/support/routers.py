"""Start kvroute routers inside the test's event loop, in front of emulated engines."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from router.app import RouterApp
from router.config import load_config

#: Fast timers so health changes show within a fraction of a second.
FAST: dict[str, Any] = {
    "health": {
        "interval_s": 0.05,
        "timeout_s": 0.5,
        "backoff_initial_s": 0.2,
        "backoff_max_s": 1.0,
    },
    "scrape": {"interval_s": 0.1},
    "events": {"replay_timeout_s": 0.5},
}


def router_config(urls: list[str], **sections: Any) -> Any:
    overrides: dict[str, Any] = {**FAST, "server": {"host": "127.0.0.1", "port": 0}}
    for name, value in sections.items():
        overrides[name] = {**overrides.get(name, {}), **value} if isinstance(value, dict) else value
    overrides["engines"] = [u if isinstance(u, dict) else {"url": u} for u in urls]
    return load_config(overrides=overrides, environ={})


async def start_router(urls: list[str], **sections: Any) -> RouterApp:
    """A started router (``app.url``); stop it with ``await app.stop()``."""
    app = RouterApp(router_config(urls, **sections))
    await app.start()
    return app


StartRouter = Callable[..., Awaitable[RouterApp]]
"""The ``routers`` fixture: start a router (``start_router``'s arguments), stopped when
the test ends."""
