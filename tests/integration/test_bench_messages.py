"""``kvroute bench --api messages``: the load generator speaks Anthropic Messages and
measures the same usage (prompt, cached and output tokens) as on the OpenAI routes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from support.clients import REQUEST_TIMEOUT_S, metric, metrics
from support.engines import poll, start_test_engine
from support.routers import start_router

from router.app import RouterApp
from router.bench.loadgen import run_load
from router.emulator import EmulatedEngine
from router.workloads.generated import chat_workload, shared_prefix_workload


@pytest_asyncio.fixture
async def stack(ipc_dir: Path) -> AsyncIterator[tuple[EmulatedEngine, RouterApp]]:
    engine = await start_test_engine(
        engine_id="bench-msgs",
        kv_events_endpoint=f"ipc://{ipc_dir}/bench-msgs",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
    )
    app = await start_router([engine.url])
    await poll(lambda: app.subscriber and app.subscriber.stats.replays["ok"] == 1)
    yield engine, app
    await app.stop()
    await engine.stop()


@pytest.mark.parametrize("stream", [True, False])
async def test_conversations_as_messages_report_the_engines_token_counts(
    stack: tuple[EmulatedEngine, RouterApp], http: aiohttp.ClientSession, stream: bool
) -> None:
    engine, app = stack
    specs = chat_workload(3, 2, 64, 20, 6, seed=4)
    specs += list(shared_prefix_workload(1, 2, 40, 8, 4, seed=5, shuffle=False))
    results = await run_load(
        app.url,
        specs,
        concurrency=3,
        model="kvroute-emulated",
        stream=stream,
        api="messages",
        timeout=REQUEST_TIMEOUT_S,
    )
    assert [r.error for r in results if not r.ok] == []
    assert len(results) == len(specs) + 3  # every conversation's second turn too
    assert all(r.text and r.completion_tokens > 0 for r in results)
    second_turns = [
        r for r in results if r.spec.group.startswith("conversation") and r.cached_tokens
    ]
    assert len(second_turns) >= 3  # each second turn finds its first turn cached
    samples = await metrics(http, engine.url)
    assert sum(r.prompt_tokens for r in results) == metric(
        samples, "vllm:prefix_cache_queries_total"
    )
    assert sum(r.cached_tokens for r in results) == metric(samples, "vllm:prefix_cache_hits_total")
