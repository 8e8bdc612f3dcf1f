"""Start kvroute routers inside the test's event loop, in front of emulated engines."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from router.app import RouterApp
from router.config import load_config
from router.fleet.registry import EngineState
from support.engines import poll

#: Fast timers so health changes show within a fraction of a second. The bounds on a
#: call (a probe's answer, a connection to an engine) stay far above what a loaded
#: machine takes: the in-process engines share the test's event loop, and a loop held
#: up for a second fires every timer that came due meanwhile before it reads the
#: answers that came too (an engine ejected, or a request retried elsewhere, that
#: the test did not make). Tests of a frozen engine set their own.
FAST: dict[str, Any] = {
    "health": {
        "interval_s": 0.05,
        "timeout_s": 5.0,
        "backoff_initial_s": 0.2,
        "backoff_max_s": 1.0,
    },
    "proxy": {"connect_timeout_s": 10.0},
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
    """A started router (``app.url``), every engine that answers in play (see
    :func:`engines_in_play`); stop it with ``await app.stop()``."""
    app = RouterApp(router_config(urls, **sections))
    await app.start()
    await engines_in_play(app)
    return app


async def engines_in_play(app: RouterApp, timeout: float = 30.0) -> None:
    """Wait until the router has settled every engine that answers ``/health`` now.

    A router's start probes each engine once; on a loaded machine that probe can time
    out (a test's own short health timeout, or a loop held up past :data:`FAST`'s), and
    the engine then waits ``pending`` for a later one: a request sent at once would find
    no engine. An engine that does not answer here (a test's dead, stalled or failing
    URL) is not waited for, and nothing fails: a test asserts what it expects of its
    engines itself."""
    pending = [e for e in app.registry if e.state is EngineState.PENDING]
    if not pending:
        return
    answering = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        for engine in pending:
            try:
                async with http.get(engine.url + "/health") as resp:
                    if resp.status == 200:
                        answering.append(engine)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
    with contextlib.suppress(AssertionError):
        await poll(lambda: all(e.state is not EngineState.PENDING for e in answering), timeout)


StartRouter = Callable[..., Awaitable[RouterApp]]
"""The ``routers`` fixture: start a router (``start_router``'s arguments), stopped when
the test ends."""
