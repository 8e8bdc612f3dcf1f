"""Launching emulated engines for tests: in this process, or as a separate process.

Every address is on loopback. A subprocess engine runs in its own process group, which
``stop()`` (called from a finalizer) terminates and, if need be, kills.
"""

from __future__ import annotations

import asyncio
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from router.emulator import EmulatedEngine, EmulatorConfig, start_engine
from router.engine_model import EngineParams

LISTENING = re.compile(r"listening on (http://\S+)")

#: Small, fast engines: a 2,000-token prompt fits many times over; 1,000x real time.
TEST_PARAMS = EngineParams(num_gpu_blocks=1_024, max_model_len=16_384)


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


class EngineProcess:
    """``kvroute engine`` in a child process with its own process group."""

    def __init__(self, args: Sequence[str], timeout: float = 20.0) -> None:
        self.args = [sys.executable, "-m", "router", "engine", "--host", "127.0.0.1", *args]
        self.proc = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.line = ""
        try:
            self.line = self._read_line(timeout)
        except BaseException:
            self.stop()
            raise
        match = LISTENING.search(self.line)
        if match is None:
            self.stop()
            raise RuntimeError(f"unexpected start-up line: {self.line!r}")
        self.url = match.group(1)

    def _read_line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if sel.select(timeout=deadline - time.monotonic()):
                    line = self.proc.stdout.readline()
                    if line:
                        return line.strip()
                    self.proc.wait(timeout=5)
                    errors = self.proc.stderr.read() if self.proc.stderr else ""
                    raise RuntimeError(f"engine exited before listening: {errors}")
        raise TimeoutError(f"engine did not print its address within {timeout} s")

    def terminate(self) -> int:
        """SIGTERM the engine and wait for its exit code."""
        os.killpg(self.proc.pid, signal.SIGTERM)
        return self.proc.wait(timeout=10)

    def stop(self) -> None:
        """End the process group whatever its state (safe to call twice)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
            except ProcessLookupError:
                pass
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None and not stream.closed:
                stream.close()


async def poll(predicate: Any, timeout: float = 5.0, interval: float = 0.005) -> Any:
    """Await ``predicate()`` (sync or async) until it is truthy; fail after ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(interval)
