"""The emulator beside real vLLM: the same requests (token-id prompts, so both engines see
the same tokens), the same block size and cache size; cached tokens per request, the
sequence of KV events (modulo hashes), the metric names the router reads and the error
answers must agree. What still differs is listed in docs/engine-emulator.md."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from support.clients import Subscriber, metrics, post
from support.engines import start_test_engine
from support.real_vllm import BLOCK_SIZE, VllmEngine
from support.vllm_prompts import MODEL

from router.emulator import EmulatedEngine
from router.engine_model import EngineParams
from router.events.types import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

from .conftest import NUM_BLOCKS

#: Metrics the router scrapes from vLLM (docs/metrics.md, router/fleet/scrape.py).
ROUTER_READS = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:cache_config_info",
}


@pytest_asyncio.fixture
async def emulator(tmp_path: Any) -> AsyncIterator[EmulatedEngine]:
    engine = await start_test_engine(
        model=MODEL,
        params=EngineParams(block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS, max_model_len=4096),
        kv_events_endpoint=f"ipc://{tmp_path}/emu-events",
        kv_events_replay_endpoint=f"ipc://{tmp_path}/emu-replay",
        kv_events_topic="kv-events",
    )
    yield engine
    await engine.stop()


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 300) for _ in range(n)]


def sequence() -> list[list[int]]:
    """A prompt, itself again, extended, another one, a prefix of the first."""
    a, b = ids(200, 1), ids(150, 2)
    return [a, a, a + ids(70, 3), b, a[:100]]


def shape(batch: EventBatch) -> list[tuple[Any, ...]]:
    """A batch's events without their hashes."""
    out: list[tuple[Any, ...]] = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            out.append(
                (
                    "BlockStored",
                    len(event.block_hashes),
                    len(event.token_ids),
                    event.parent_block_hash is not None,
                    event.block_size,
                    event.medium,
                )
            )
        elif isinstance(event, BlockRemoved):
            out.append(("BlockRemoved", len(event.block_hashes)))
        elif isinstance(event, AllBlocksCleared):
            out.append(("AllBlocksCleared",))
    return out


async def fresh(http: aiohttp.ClientSession, url: str) -> None:
    """An empty cache whose AllBlocksCleared has been published (vLLM sends it with its
    next step)."""
    async with http.post(f"{url}/reset_prefix_cache") as resp:
        assert resp.status == 200
    status, _ = await post(
        http, f"{url}/v1/completions", {"model": MODEL, "prompt": [5], "max_tokens": 1}
    )
    assert status == 200


async def subscribed(http: aiohttp.ClientSession, url: str, sub: Subscriber) -> None:
    """Return once ``sub`` receives the engine's events and its cache is empty: a block
    is stored, the cache reset, and the reset's AllBlocksCleared seen (again, until a
    deadline, while the subscription is still joining: a slow joiner misses what is
    published before it is connected, which on a loaded machine is more than a fixed
    half-second covers)."""
    deadline = asyncio.get_running_loop().time() + 60
    probe = {"model": MODEL, "prompt": ids(2 * BLOCK_SIZE, 99), "max_tokens": 1}
    while asyncio.get_running_loop().time() < deadline:
        status, _ = await post(http, f"{url}/v1/completions", probe)
        assert status == 200
        await fresh(http, url)
        try:
            while True:
                message = await sub.recv(timeout=5.0)
                if ("AllBlocksCleared",) in shape(message.batch):
                    return
        except (TimeoutError, asyncio.TimeoutError):
            continue
    raise AssertionError(f"no KV events from {url} within 60 s")


async def drained(sub: Subscriber, quiet: float = 3.0) -> list[list[tuple[Any, ...]]]:
    """The shapes of the batches received until ``quiet`` s pass without one."""
    shapes = []
    while True:
        try:
            message = await sub.recv(timeout=quiet)
        except (TimeoutError, asyncio.TimeoutError):
            return shapes
        batch_shape = shape(message.batch)
        if batch_shape:
            shapes.append(batch_shape)


async def run(
    http: aiohttp.ClientSession, url: str, events_endpoint: str
) -> tuple[list[int], list[list[tuple[Any, ...]]]]:
    sub = Subscriber(events_endpoint)
    try:
        await subscribed(http, url, sub)
        cached = []
        for prompt in sequence():
            status, body = await post(
                http,
                f"{url}/v1/completions",
                {"model": MODEL, "prompt": prompt, "max_tokens": 1},
            )
            assert status == 200, body
            cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        return cached, await drained(sub)
    finally:
        sub.close()


async def test_cached_tokens_and_kv_events_match_real_vllm(
    vllm_pair: tuple[VllmEngine, VllmEngine],
    emulator: EmulatedEngine,
    http: aiohttp.ClientSession,
) -> None:
    a, _ = vllm_pair
    real_cached, real_events = await run(http, a.url, a.events_endpoint)
    emu_cached, emu_events = await run(http, emulator.url, emulator.kv_events_endpoint or "")
    assert real_cached == [0, 192, 192, 0, 96]
    assert emu_cached == real_cached
    # The first batch may hold the AllBlocksCleared of the reset before the run.
    strip = [b for b in real_events if b != [("AllBlocksCleared",)]]
    assert [b for b in emu_events if b != [("AllBlocksCleared",)]] == strip


async def test_the_metrics_the_router_reads_exist_on_both(
    vllm_pair: tuple[VllmEngine, VllmEngine],
    emulator: EmulatedEngine,
    http: aiohttp.ClientSession,
) -> None:
    real = await metrics(http, vllm_pair[0].url)
    emu = await metrics(http, emulator.url)
    families = {name.removesuffix("_total") for name in real}
    emu_families = {name.removesuffix("_total") for name in emu}
    assert ROUTER_READS <= families
    assert ROUTER_READS <= emu_families
    (real_info,) = real["vllm:cache_config_info"]
    (emu_info,) = emu["vllm:cache_config_info"]
    for label in ("block_size", "num_gpu_blocks"):
        assert real_info.labels[label] == emu_info.labels[label]


@pytest.mark.parametrize(
    ("case", "body"),
    [
        ("unknown model", {"model": "no-such-model", "prompt": "hi", "max_tokens": 1}),
        ("prompt too long", {"model": MODEL, "prompt": [7] * 5000, "max_tokens": 1}),
        ("bad json", b'{"model": "tiny-llama", "prompt": '),
        ("max_tokens negative", {"model": MODEL, "prompt": "hi", "max_tokens": -1}),
        ("temperature not a number", {"model": MODEL, "prompt": "hi", "temperature": "hot"}),
        (
            "an object in vllm_xargs",
            {"model": MODEL, "prompt": "hi", "vllm_xargs": {"kv_transfer_params": {}}},
        ),
    ],
)
async def test_error_answers_match_real_vllm(
    case: str,
    body: Any,
    vllm_pair: tuple[VllmEngine, VllmEngine],
    emulator: EmulatedEngine,
    http: aiohttp.ClientSession,
) -> None:
    headers = {"Content-Type": "application/json"}
    real_status, real_body = await post(http, f"{vllm_pair[0].url}/v1/completions", body, headers)
    emu_status, emu_body = await post(http, f"{emulator.url}/v1/completions", body, headers)
    assert (case, emu_status) == (case, real_status)
    assert set(emu_body["error"]) == set(real_body["error"]), (real_body, emu_body)
    assert emu_body["error"]["type"] == real_body["error"]["type"], (real_body, emu_body)


async def last_event(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    """The last ``data:`` of a server-sent event stream (Responses: ``event:`` lines too)."""
    headers = {"Content-Type": "application/json"}
    async with http.post(url, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        text = (await resp.read()).decode()
    data = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    return json.loads(data[-1])


async def test_where_vllm_differs_from_the_hosted_apis_the_emulator_is_vllm(
    vllm_pair: tuple[VllmEngine, VllmEngine],
    emulator: EmulatedEngine,
    http: aiohttp.ClientSession,
) -> None:
    """Anthropic's API refuses a ``system`` role inside ``messages`` and names messages
    ``msg_…``; OpenAI's ends a Responses stream cut by ``max_output_tokens`` with
    ``response.incomplete``. vLLM 0.32 takes the inline system message, names the
    message after its chat completion and ends with ``response.completed`` whose
    response is incomplete: the emulator does as vLLM does."""
    inline_system = {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "answer briefly"},
        ],
    }
    cut = {
        "model": MODEL,
        "input": "hi",
        "max_output_tokens": 2,
        "ignore_eos": True,
        "stream": True,
        "store": False,
    }
    for url in (vllm_pair[0].url, emulator.url):
        status, message = await post(http, f"{url}/v1/messages", inline_system)
        assert status == 200, (url, message)
        assert message["id"].startswith("chatcmpl-"), (url, message["id"])
        last = await last_event(http, f"{url}/v1/responses", cut)
        assert last["type"] == "response.completed", (url, last["type"])
        response = last["response"]
        assert response["status"] == "incomplete", (url, response["status"])
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}, url
