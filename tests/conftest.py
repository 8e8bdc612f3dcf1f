"""Fixtures shared by every suite: an HTTP client, a session-wide emulated engine and
routers stopped when the test ends; and the time limit of an async test's call."""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, settings
from pytest_timeout import _get_item_settings
from support.clients import post, session
from support.engines import start_test_engine
from support.hf_tokenizer import train_tiny_tokenizer
from support.redis import delete_namespace, random_namespace, session_redis_url
from support.routers import StartRouter, start_router

from router.app import RouterApp
from router.emulator import EmulatedEngine

# Property-based tests: a bounded profile in `make test`, a long one in `make fuzz`. The
# bounded one is derandomized: `make test` (and CI) draws the same examples every run, so
# a rare input cannot fail one run in three at random; `make fuzz` explores afresh, and
# what it finds becomes an `@example`.
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "fuzz", max_examples=3_000, deadline=None, suppress_health_check=list(HealthCheck)
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# Parallel runs (`make test` runs pytest-xdist with `--dist loadscope`, and the scheduler
# below says what a scope is): a file's tests run in one worker, so that its
# module-scoped fixtures (a fleet of engines) are built once; the real-vLLM files run in
# one worker (their engines share a package-scoped pair, and two engines compiling at
# once fill both cores); the tests of the files in SPREAD are independent and long, and
# go to whichever worker is free, one by one. The longest scopes are handed out first
# (measured with `pytest --durations=0`; a hint, not a contract), so that no long one
# starts last and stretches the run. (pytest-xdist's own `loadgroup` cannot be used:
# it renames node ids in a way pytest 9.2 no longer sees.)
SPREAD = frozenset({"tests/unit/test_sim_matrix.py"})
LONGEST_FIRST = (
    "realvllm",
    "tests/unit/test_sim_matrix.py",
    "tests/integration/test_router_disagg.py",
    "tests/integration/test_prefill_isolation.py",
    "tests/fuzz/test_http_hostile.py",
    "tests/integration/test_bench_run.py",
    "tests/integration/test_indexer.py",
    "tests/integration/test_router_replicas.py",
    "tests/integration/test_slow_clients.py",
    "tests/integration/test_latency_routing.py",
    "tests/unit/test_runtime_dependencies.py",
    "tests/integration/test_replicated_index.py",
    "tests/integration/test_index_flood.py",
    "tests/integration/test_redis_index.py",
)


def _group(nodeid: str) -> str:
    """A test's file, or the whole real-vLLM tier."""
    path = nodeid.split("::", 1)[0]
    return "realvllm" if path.startswith("tests/realvllm/") else path


def _scope(nodeid: str) -> str:
    """The tests that must share a worker: a group, or a test of SPREAD alone."""
    group = _group(nodeid)
    return nodeid if group in SPREAD else group


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class ByScope(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    return ByScope(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # only a parallel run's workers collect for it
        return
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # Stable: file order kept within a scope.
    items.sort(key=lambda item: rank.get(_group(item.nodeid), len(rank)))


#: An async test's call is cancelled this long before pytest-timeout's limit for the
#: test: what its teardown is left.
TEARDOWN_TIME_S = 10.0
_STARTED = pytest.StashKey[float]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_STARTED] = time.monotonic()  # about when pytest-timeout's clock starts


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """An async test still running ``TEARDOWN_TIME_S`` before its time limit is cancelled
    where it waits, and fails with that place in its traceback; its teardown then runs.

    pytest-timeout's own end for it comes from a watchdog thread that ends the whole
    worker: no teardown (child processes are left running) and no traceback of the
    test's task. Its signal method, which would raise in the test, cannot reach one
    waiting on the event loop: asyncio swallows an exception raised in a callback."""
    __tracebackhide__ = True
    test = getattr(item, "obj", None)
    limit = _get_item_settings(item).timeout
    if not (limit and inspect.iscoroutinefunction(test)):
        return (yield)
    left = limit - (time.monotonic() - item.stash[_STARTED]) - TEARDOWN_TIME_S
    if left <= 0:
        return (yield)

    @functools.wraps(test)
    async def bounded(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        task = asyncio.ensure_future(test(*args, **kwargs))
        try:
            done, _ = await asyncio.wait({task}, timeout=left)
        except asyncio.CancelledError:  # the run is interrupted: the test goes with it
            task.cancel()
            raise
        if not done:
            task.cancel()
            try:
                await task  # its finally clauses run as it ends
            except asyncio.CancelledError:
                pytest.fail(
                    f"still running {limit - TEARDOWN_TIME_S:.0f} s into its {limit:.0f} s "
                    "time limit: cancelled where it waited (the traceback above)"
                )
        return task.result()

    item.obj = bounded  # type: ignore[attr-defined]
    try:
        return (yield)
    finally:
        item.obj = test  # type: ignore[attr-defined]


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Tests run on uvloop, like every kvroute process in production."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop}


@pytest_asyncio.fixture(scope="session")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with session() as client:
        yield client


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


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BPE tokenizer.json trained for the session (no downloads)."""
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tokenizer.json")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of the Redis the tests share (a throw-away redis-server, ``REDIS_URL``, or a
    container); skips the test when none can be had."""
    with session_redis_url() as url:
        if url is None:
            pytest.skip("no Redis: put redis-server on the PATH, set REDIS_URL, or run Docker")
        yield url


@pytest.fixture
def redis_namespace(redis_url: str) -> Iterator[str]:
    """A key namespace of this test alone, deleted afterwards."""
    namespace = random_namespace()
    yield namespace
    delete_namespace(redis_url, namespace)


@pytest_asyncio.fixture
async def routers() -> AsyncIterator[StartRouter]:
    """Start routers (``start_router``'s arguments); they are stopped afterwards."""
    started: list[RouterApp] = []

    async def start(urls: list[str], **sections: Any) -> RouterApp:
        app = await start_router(urls, **sections)
        started.append(app)
        return app

    yield start
    for app in started:
        await app.stop()
