"""Injected faults, set by flags or at run time through /admin/faults, over real sockets."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from support.clients import Subscriber, get, metric_sum, metrics, post, replay
from support.engines import EngineProcess, poll, start_test_engine

from router.emulator import EmulatedEngine
from router.emulator.kv_publisher import GARBAGE_FRAMES
from router.events.vllm import END_SEQ, decode_seq


@pytest_asyncio.fixture(scope="module")
async def faulty(ipc_dir: Path) -> AsyncIterator[EmulatedEngine]:
    engine = await start_test_engine(
        engine_id="faulty",
        kv_events_endpoint=f"ipc://{ipc_dir}/faulty-events",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
    )
    yield engine
    await engine.stop()


@pytest_asyncio.fixture(scope="module")
async def slow() -> AsyncIterator[EmulatedEngine]:
    """An engine at 1/20 of real time: a long answer takes seconds, so a client can
    leave while it runs."""
    engine = await start_test_engine(engine_id="slow", time_scale=0.05)
    yield engine
    await engine.stop()


@pytest_asyncio.fixture
async def admin(
    faulty: EmulatedEngine, slow: EmulatedEngine, http: aiohttp.ClientSession
) -> AsyncIterator[Any]:
    """Sets faults on an engine for one test; every engine is healed afterwards."""

    async def set_faults(engine: EmulatedEngine, **faults: Any) -> dict[str, Any]:
        status, state = await post(http, f"{engine.url}/admin/faults", faults)
        assert status == 200, state
        return state

    yield set_faults
    for engine in (faulty, slow):
        async with http.delete(f"{engine.url}/admin/faults") as resp:
            assert resp.status == 200


async def complete(
    http: aiohttp.ClientSession, engine: EmulatedEngine, **body: Any
) -> tuple[int, Any]:
    return await post(http, f"{engine.url}/v1/completions", {"prompt": "a b c", **body})


async def read_stream(resp: aiohttp.ClientResponse) -> tuple[list[Any], bool]:
    """SSE payloads read until the stream ends; and whether it ended cleanly."""
    payloads: list[Any] = []
    try:
        async for line in resp.content:
            if line.startswith(b"data: "):
                text = line[len(b"data: ") :].strip().decode()
                payloads.append(text if text == "[DONE]" else json.loads(text))
    except aiohttp.ClientPayloadError:
        return payloads, False
    return payloads, True


async def next_data_line(resp: aiohttp.ClientResponse) -> bytes:
    """The next SSE ``data:`` line (blank separator lines skipped)."""
    while True:
        line = await resp.content.readline()
        if line.strip() or not line:
            return line


def token_count(payloads: list[Any]) -> int:
    chunks = [p for p in payloads if isinstance(p, dict) and p["choices"]]
    return sum(len(p["choices"][0]["text"].split()) for p in chunks)


async def test_the_admin_endpoint_reads_changes_and_clears_faults(
    faulty: EmulatedEngine, http: aiohttp.ClientSession, admin: Any
) -> None:
    status, state = await get(http, f"{faulty.url}/admin/faults")
    assert status == 200 and state["fail_rate"] == 0.0 and state["stall_after_tokens"] is None
    assert (await admin(faulty, fail_rate=1.0))["fail_rate"] == 1.0
    status, answer = await complete(http, faulty)
    assert status == 500 and answer["error"]["message"] == "injected failure (fail_rate)"
    async with http.delete(f"{faulty.url}/admin/faults") as resp:
        assert (await resp.json())["fail_rate"] == 0.0
    assert (await complete(http, faulty))[0] == 200
    for bad in ({"fail_rate": 3}, {"no_such_fault": 1}, {"drop_after_tokens": "3"}):
        status, answer = await post(http, f"{faulty.url}/admin/faults", bad)
        assert status == 400, bad


async def test_a_fail_rate_fails_that_fraction_of_requests(
    faulty: EmulatedEngine, http: aiohttp.ClientSession, admin: Any
) -> None:
    await admin(faulty, fail_rate=0.5)
    before = metric_sum(await metrics(http, faulty.url), "kvroute_emulator_faults_injected_total")
    statuses = [(await complete(http, faulty, max_tokens=1))[0] for _ in range(60)]
    failed = statuses.count(500)
    assert set(statuses) == {200, 500} and 10 <= failed <= 50
    after = metric_sum(await metrics(http, faulty.url), "kvroute_emulator_faults_injected_total")
    assert after - before == failed


async def test_extra_latency_delays_every_answer(
    faulty: EmulatedEngine, http: aiohttp.ClientSession, admin: Any
) -> None:
    await admin(faulty, extra_latency_ms=150)
    started = time.monotonic()
    assert (await complete(http, faulty, max_tokens=1))[0] == 200
    assert time.monotonic() - started >= 0.15


async def test_a_failing_health_check_answers_503_until_healed(
    faulty: EmulatedEngine, http: aiohttp.ClientSession, admin: Any
) -> None:
    await admin(faulty, fail_health=True)
    async with http.get(f"{faulty.url}/health") as resp:
        assert resp.status == 503
    await admin(faulty, fail_health=False)
    async with http.get(f"{faulty.url}/health") as resp:
        assert resp.status == 200


async def test_a_stalled_stream_stops_sending_but_keeps_the_connection(
    slow: EmulatedEngine, http: aiohttp.ClientSession, admin: Any
) -> None:
    await admin(slow, stall_after_tokens=2)
    aborted = "kvroute_emulator_aborted_requests_total"
    before = metric_sum(await metrics(http, slow.url), aborted)
    body = {"prompt": "a b c", "max_tokens": 5_000, "stream": True}
    async with http.post(f"{slow.url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        tokens = 0
        while tokens < 2:
            line = await next_data_line(resp)
            tokens += len(json.loads(line[len(b"data: ") :])["choices"][0]["text"].split())
        assert tokens == 2
        # Nothing more arrives, and the connection is still open.
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(next_data_line(resp), 0.3)
        assert not resp.content.at_eof()
    # The client leaving reaches the engine: the running request is aborted.

    async def counted() -> bool:
        return metric_sum(await metrics(http, slow.url), aborted) == before + 1

    await poll(counted)


async def test_a_stalled_non_streaming_answer_never_comes(
    faulty: EmulatedEngine, http: aiohttp.ClientSession, admin: Any
) -> None:
    await admin(faulty, stall_after_tokens=0)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(complete(http, faulty, max_tokens=2), 0.3)


async def test_a_dropped_stream_is_cut_after_the_tokens_it_was_allowed(
    faulty: EmulatedEngine, http: aiohttp.ClientSession, admin: Any
) -> None:
    await admin(faulty, drop_after_tokens=3)
    body = {"prompt": "a b c", "max_tokens": 10, "stream": True}
    async with http.post(f"{faulty.url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        payloads, clean = await read_stream(resp)
    assert not clean and token_count(payloads) == 3 and "[DONE]" not in payloads


async def test_a_dropped_non_streaming_answer_is_cut_mid_body(
    faulty: EmulatedEngine, http: aiohttp.ClientSession, admin: Any
) -> None:
    await admin(faulty, drop_after_tokens=0)
    async with http.post(f"{faulty.url}/v1/completions", json={"prompt": "a b"}) as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()


async def test_a_client_that_leaves_mid_stream_is_counted_as_aborted(
    slow: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    aborted = "kvroute_emulator_aborted_requests_total"
    before = metric_sum(await metrics(http, slow.url), aborted)
    body = {"prompt": "leave early", "max_tokens": 5_000, "stream": True}
    async with http.post(f"{slow.url}/v1/completions", json=body) as resp:
        await resp.content.readline()

    async def counted() -> bool:
        return metric_sum(await metrics(http, slow.url), aborted) == before + 1

    await poll(counted)
    await poll(lambda: slow.state.drivers[0].model.stats().num_running == 0)


async def test_skipped_kv_event_batches_leave_a_gap_that_replay_fills(
    faulty: EmulatedEngine, http: aiohttp.ClientSession, admin: Any
) -> None:
    sub = Subscriber(faulty.kv_events_endpoint or "")
    try:
        probe = await sub.sync(http, faulty.url)
        await admin(faulty, kv_events_skip=1)
        await complete(http, faulty, prompt=" ".join(f"gap{i}" for i in range(40)))
        await complete(http, faulty, prompt=" ".join(f"after{i}" for i in range(40)))
        received = await sub.recv()
    finally:
        sub.close()
    skipped = probe.seq + 1
    assert received.seq == skipped + 1  # the gap a subscriber must notice
    replies = await replay(faulty.kv_events_replay_endpoint or "", skipped)
    assert [decode_seq(s) for s, _ in replies if s != END_SEQ][:2] == [skipped, skipped + 1]


async def test_garbage_messages_precede_the_next_batches(
    faulty: EmulatedEngine, http: aiohttp.ClientSession, admin: Any
) -> None:
    sub = Subscriber(faulty.kv_events_endpoint or "")
    try:
        probe = await sub.sync(http, faulty.url)
        await admin(faulty, kv_events_garbage=1)
        await complete(http, faulty, prompt=" ".join(f"junk{i}" for i in range(40)))
        garbage = await asyncio.wait_for(sub.sock.recv_multipart(), 5)
        topic, seq, _ = await asyncio.wait_for(sub.sock.recv_multipart(), 5)
    finally:
        sub.close()
    assert garbage == [topic, *GARBAGE_FRAMES]
    assert decode_seq(seq) == probe.seq + 1  # garbage takes no sequence number


async def test_faults_set_by_flags(http: aiohttp.ClientSession) -> None:
    flags = ["--port", "0", "--cache-blocks", "64", "--fail-health", "--fail-rate", "1"]
    proc = EngineProcess(flags)
    try:
        async with http.get(f"{proc.url}/health") as resp:
            assert resp.status == 503
        status, _ = await post(http, f"{proc.url}/v1/completions", {"prompt": "a"})
        assert status == 500
        _, state = await get(http, f"{proc.url}/admin/faults")
        assert state["fail_health"] is True and state["fail_rate"] == 1.0
    finally:
        proc.stop()
