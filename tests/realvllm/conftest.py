"""The real-vLLM tier: two real vLLM engines (CPU build, a tiny Llama with random weights)
shared by this package's tests and stopped once they are done (an idle vLLM CPU worker
that has done a NIXL transfer keeps polling a core). Each publishes KV events on
``ipc://`` endpoints and can hand KV over NIXL (``kv_both``), so the same pair serves
aggregated tests and prefill/decode tests.

``REAL_VLLM_ATTACH=FILE`` uses a pair that ``python tests/support/real_vllm.py FILE``
keeps running instead (for quick iterations; tests that kill an engine skip then).

Skipped, with the reason, where ``make vllm`` could not install vLLM (see
``tests/support/real_vllm.py``). Tests that kill an engine restart it on the same port
and endpoints, and before every test an engine of the pair that is down or does not
answer ``/health`` is restarted the same way (with a warning naming the test before it),
so one test's failure is that test's alone and later tests find the pair as it was.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from support.real_vllm import TIER_TEST_TIMEOUT_S, VllmEngine, attached_pair, unavailable_reason
from support.tiny_model import make_tiny_llama

REASON = unavailable_reason()
#: KV blocks per engine: small enough that a few long prompts evict, large enough that
#: one test's prompts stay cached (a block is 32 tokens).
NUM_BLOCKS = 192


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    tier = [item for item in items if here in Path(str(item.fspath)).parents]
    if REASON is not None:
        skip = pytest.mark.skip(reason=f"real vLLM unavailable: {REASON}")
        for item in tier:
            item.add_marker(skip)
    else:
        # The tier's first test starts the engine pair (about a minute on 2 idle cores,
        # over two when they are busy), and any test may find an engine to restart
        # (``pair_answers``): a test's time limit is a start-up's own deadline plus
        # pytest's usual 120 s, not the 120 s alone.
        for item in tier:
            item.add_marker(pytest.mark.timeout(TIER_TEST_TIMEOUT_S))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report carries both engines' log tails: a real engine's view of
    a failure (a stuck transfer, a refused request) is often the only explanation, and
    the logs are temporary files a CI run does not keep."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    pair = getattr(item, "funcargs", {}).get("vllm_pair")
    if report.failed and pair:
        for engine in pair:
            report.sections.append((f"vLLM {engine.name} log (last 60 lines)", engine.log_tail(60)))


@pytest.fixture(autouse=True)
def pair_answers(request: pytest.FixtureRequest) -> None:
    """Before a test of the pair: an engine this session started that has died or does
    not answer ``/health`` (a test before failed while it was down, or its restart
    stalled) is restarted, so the failure stays with the test that caused it."""
    if "vllm_pair" not in request.fixturenames:
        return
    pair: tuple[VllmEngine, VllmEngine] = request.getfixturevalue("vllm_pair")
    for engine in pair:
        if engine.proc is None or engine.healthy():
            continue
        warnings.warn(
            f"vLLM {engine.name} was down before {request.node.nodeid}; restarted it",
            stacklevel=1,
        )
        with contextlib.ExitStack() as others:  # the other engine idles on a busy core
            for other in pair:
                if other is not engine:
                    others.enter_context(other.paused())
            engine.restart()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """The tier's client: a real engine's answer has a long tail on a loaded 2-core
    machine (a first batch of a new shape compiles; a NIXL transfer polls on a shared
    core), so a request gets 90 s here, within pytest's 120 s per test, instead of the
    emulator suites' 30 s."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as session:
        yield session


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def vllm_ipc(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vipc")


@pytest.fixture(scope="package")
def vllm_pair(vllm_model: Path, vllm_ipc: Path) -> Iterator[tuple[VllmEngine, VllmEngine]]:
    """Engines ``a`` and ``b``, started side by side (about a minute on 2 cores)."""
    attach = os.environ.get("REAL_VLLM_ATTACH")
    if attach:  # a pair kept running by `python tests/support/real_vllm.py FILE`
        yield attached_pair(Path(attach))
        return
    cores = os.cpu_count() or 1
    engines = tuple(
        VllmEngine(name, vllm_model, vllm_ipc, num_gpu_blocks=NUM_BLOCKS, nixl=True, cpu=i % cores)
        for i, name in enumerate(("a", "b"))
    )
    try:
        for engine in engines:
            engine.start()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda e: e.wait_ready(), engines))
        yield engines  # type: ignore[misc]
    finally:
        for engine in engines:
            engine.stop()
