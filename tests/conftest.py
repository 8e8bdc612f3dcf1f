"""Fixtures shared by every suite: an HTTP client and a session-wide emulated engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from support.clients import post
from support.engines import start_test_engine

from router.emulator import EmulatedEngine


@pytest_asyncio.fixture(scope="session")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


@pytest.fixture(scope="session")
def ipc_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ipc")


@pytest_asyncio.fixture(scope="session")
async def shared_engine(ipc_dir: Path) -> AsyncIterator[EmulatedEngine]:
    """One engine for the suites that only need a fresh cache: events bound on ipc://."""
    engine = await start_test_engine(
        engine_id="shared",
        kv_events_endpoint=f"ipc://{ipc_dir}/shared-events",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
        lora_modules=("sql-adapter",),
    )
    yield engine
    await engine.stop()


@pytest_asyncio.fixture
async def engine(shared_engine: EmulatedEngine, http: aiohttp.ClientSession) -> EmulatedEngine:
    """The shared engine with an empty prefix cache."""
    status, _ = await post(http, f"{shared_engine.url}/reset_prefix_cache", {})
    assert status == 200
    return shared_engine
