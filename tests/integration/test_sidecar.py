"""kvroute sidecar in front of a decode engine (llm-d's P/D sidecar protocol).

127.0.0.2 and 127.0.0.3 stand for other hosts: both are loopback addresses."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
import pytest
import pytest_asyncio
from support.clients import metric_sum, metrics, post
from support.engines import poll, start_test_engine
from support.held_stream import HeldStreamEngine, StreamingClient
from support.listeners import DialCounter, hostile_handoff

from router.emulator import EmulatedEngine
from router.frontends.sidecar import start_sidecar


def prompt(tag: str, words: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(words))


@pytest_asyncio.fixture(scope="module")
async def pod() -> AsyncIterator[dict[str, object]]:
    decode = await start_test_engine(engine_id="pod-decode", role="decode", handoff_failure="error")
    prefill = await start_test_engine(engine_id="remote-prefill", role="prefill", host="127.0.0.2")
    stranger = await start_test_engine(engine_id="stranger", role="prefill", host="127.0.0.3")
    runner, sidecar, url = await start_sidecar(decode.url, ["127.0.0.2/32"])
    yield {"decode": decode, "prefill": prefill, "stranger": stranger, "url": url}
    await runner.cleanup()
    await sidecar.close()
    for engine in (decode, prefill, stranger):
        await engine.stop()


async def pulled(http: aiohttp.ClientSession, engine: EmulatedEngine) -> float:
    return metric_sum(await metrics(http, engine.url), "kvroute_emulator_kv_pulled_tokens_total")


async def test_the_named_prefill_engine_prefills_and_the_local_engine_pulls(
    pod: dict, http: aiohttp.ClientSession
) -> None:
    before = await pulled(http, pod["decode"])
    target = f"127.0.0.2:{pod['prefill'].port}"
    status, body = await post(
        http,
        f"{pod['url']}/v1/completions",
        {"prompt": prompt("side", 1000), "max_tokens": 3},
        headers={"x-prefiller-host-port": target},
    )
    assert status == 200, body
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert await pulled(http, pod["decode"]) - before >= 984
    prefill_tokens = metric_sum(await metrics(http, pod["prefill"].url), "vllm:prompt_tokens_total")
    assert prefill_tokens >= 1000


async def test_a_stream_through_the_sidecar(pod: dict, http: aiohttp.ClientSession) -> None:
    target = f"127.0.0.2:{pod['prefill'].port}"
    body = {"prompt": prompt("sidestream", 700), "max_tokens": 4, "stream": True}
    async with http.post(
        f"{pod['url']}/v1/completions", json=body, headers={"x-prefiller-host-port": target}
    ) as resp:
        assert resp.status == 200
        text = (await resp.read()).decode()
    assert text.endswith("data: [DONE]\n\n") and '"error"' not in text


async def test_a_client_that_closes_on_done_is_not_logged_as_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client closing as it reads ``data: [DONE]``, just as the local engine ends its
    stream, had its whole answer: nothing above debug level (issue 44, item 12)."""
    engine = HeldStreamEngine()
    runner, sidecar, url = await start_sidecar(await engine.start(), [])
    caplog.set_level(logging.DEBUG, logger="kvroute")
    try:
        client = await StreamingClient.post(
            "127.0.0.1",
            urlsplit(url).port or 0,
            "/v1/completions",
            b'{"model": "m", "prompt": "hi", "stream": true}',
        )
        await client.read_until(b"data: [DONE]\n\n")
        engine.end()  # the engine's last chunk, then the client's close: one poll
        client.leave()
        await poll(lambda: "client left before the end of a stream" in caplog.text)
        assert [r.getMessage() for r in caplog.records if r.levelno > logging.DEBUG] == []
    finally:
        await runner.cleanup()
        await sidecar.close()
        await engine.stop()


async def test_a_target_off_the_allow_list_is_refused(
    pod: dict, http: aiohttp.ClientSession
) -> None:
    for target in (
        f"127.0.0.3:{pod['stranger'].port}",
        "8.8.8.8:80",
        f"127.0.0.1:{pod['decode'].port}",  # the pod's own engine is not a prefill target
    ):
        status, body = await post(
            http,
            f"{pod['url']}/v1/completions",
            {"prompt": "hello", "max_tokens": 1},
            headers={"x-prefiller-host-port": target},
        )
        assert status == 403, (target, status, body)
        assert body["error"]["param"] == "x-prefiller-host-port"
    strangers = metric_sum(await metrics(http, pod["stranger"].url), "vllm:prompt_tokens_total")
    assert strangers == 0  # nothing ever reached the engine off the list


async def test_a_malformed_target_is_a_400(pod: dict, http: aiohttp.ClientSession) -> None:
    for target in (f"127.0.0.2:{pod['prefill'].port}x", "127.0.0.2", "not a host:port"):
        status, body = await post(
            http,
            f"{pod['url']}/v1/completions",
            {"prompt": "hello", "max_tokens": 1},
            headers={"x-prefiller-host-port": target},
        )
        assert status == 400, (target, status, body)
        assert body["error"]["param"] == "x-prefiller-host-port"


async def test_without_the_header_requests_pass_straight_through(
    pod: dict, http: aiohttp.ClientSession
) -> None:
    status, body = await post(
        http, f"{pod['url']}/v1/completions", {"prompt": "plain request", "max_tokens": 2}
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    async with http.get(f"{pod['url']}/v1/models") as resp:
        assert resp.status == 200
        assert (await resp.json())["data"][0]["id"] == "kvroute-emulated"


async def test_client_handoff_fields_are_removed_before_the_local_engine(
    pod: dict, http: aiohttp.ClientSession
) -> None:
    counter = DialCounter()
    port = await counter.start()
    try:
        body = {"prompt": prompt("own", 40), "max_tokens": 2, **hostile_handoff(port)}
        status, answer = await post(http, f"{pod['url']}/v1/completions", body)
        assert status == 200, answer  # the decode engine fails a pull it cannot make
        target = f"127.0.0.2:{pod['prefill'].port}"
        status, answer = await post(
            http, f"{pod['url']}/v1/completions", body, headers={"x-prefiller-host-port": target}
        )
        assert status == 200, answer
        assert counter.dials == 0
    finally:
        await counter.stop()


async def test_nested_handoff_fields_are_removed_before_the_local_engine(
    pod: dict, http: aiohttp.ClientSession
) -> None:
    """``vllm_xargs`` becomes vLLM's SamplingParams.extra_args, where its engine reads
    kv_transfer_params; an object there is vLLM's own 400, so a 200 is an engine that
    never saw it."""
    counter = DialCounter()
    port = await counter.start()
    try:
        xargs = {"kv_transfer_params": hostile_handoff(port)["kv_transfer_params"], "tag": "x"}
        body = {"prompt": prompt("nested", 40), "max_tokens": 2, "vllm_xargs": xargs}
        status, answer = await post(http, f"{pod['url']}/v1/completions", body)
        assert status == 200, answer
        assert counter.dials == 0
    finally:
        await counter.stop()


async def test_a_side_channel_off_the_allow_list_is_not_pulled_from(
    http: aiohttp.ClientSession,
) -> None:
    decode = await start_test_engine(engine_id="sc-decode", role="decode", handoff_failure="error")
    prefill = await start_test_engine(
        engine_id="sc-prefill", role="prefill", host="127.0.0.2", side_channel_host="127.0.0.3"
    )
    runner, sidecar, url = await start_sidecar(decode.url, [f"127.0.0.2:{prefill.port}"])
    try:
        before = await pulled(http, decode)
        status, body = await post(
            http,
            f"{url}/v1/completions",
            {"prompt": prompt("sc", 600), "max_tokens": 2},
            headers={"x-prefiller-host-port": f"127.0.0.2:{prefill.port}"},
        )
        assert status == 200, body
        assert await pulled(http, decode) == before  # decoded locally, nothing pulled
    finally:
        await runner.cleanup()
        await sidecar.close()
        await decode.stop()
        await prefill.stop()
