"""Launching emulated engines for tests: in this process, or as a separate process.

Every address is on loopback. A subprocess engine (``EngineProcess``) runs in its own
process group, which ``stop()`` (call it in a ``finally``) terminates or kills.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable
from typing import Any

from router.emulator import EmulatedEngine, EmulatorConfig, start_engine
from router.engine_model import EngineParams
from router.process import EngineProcess

__all__ = ["EngineProcess", "engine_config", "poll", "start_test_engine"]

#: Small, fast engines: a 2,000-token prompt fits many times over; 1,000x real time. A
#: split's KV is held a minute of wall time (60,000 model seconds), not the default 480
#: model seconds: at 1,000x that is half a second, which a busy machine can outlast
#: between the prefill and the decode leg (tests of expiry set their own).
TEST_PARAMS = EngineParams(num_gpu_blocks=1_024, max_model_len=16_384, kv_hold_timeout_s=60_000.0)


def engine_config(**changes: Any) -> EmulatorConfig:
    """An engine config for tests: loopback, a free port, fast clock, fixed hash seed."""
    base: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "params": TEST_PARAMS,
        "time_scale": 0.001,
        "hash_seed": 7,
    }
    base.update(changes)
    return EmulatorConfig(**base)


async def start_test_engine(**changes: Any) -> EmulatedEngine:
    """Start an in-process engine in the running event loop (stop it with ``stop()``)."""
    return await start_engine(engine_config(**changes))


async def poll(predicate: Any, timeout: float = 30.0, interval: float = 0.005) -> Any:
    """Await ``predicate()`` (sync or async) until it is truthy; fail after ``timeout``.

    An async check may itself take up to ``timeout``: one that takes longer (a request
    to a server that stalled, which would never return) is cancelled and fails the poll.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await _within(value, timeout)
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(interval)


async def _within(check: Awaitable[Any], timeout: float) -> Any:
    """``await check``; fail if it has not returned within ``timeout`` (it is cancelled)."""
    task = asyncio.ensure_future(check)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    finally:
        if not task.done():
            task.cancel()
    if not done:
        raise AssertionError(f"a check did not return within {timeout} s")
    return task.result()


def poll_sync(predicate: Any, timeout: float = 30.0, interval: float = 0.01) -> Any:
    """``poll`` for synchronous tests: call ``predicate()`` until it is truthy."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except OSError:  # a server not listening yet
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)
