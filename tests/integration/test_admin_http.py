"""The admin endpoints on the router's HTTP listener, and ``kvroute status`` reading them."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from support.clients import post
from support.engines import poll, start_test_engine
from support.routers import start_router

from router.app import RouterApp
from router.cli import main
from router.emulator import EmulatedEngine
from router.topology import Topology


@pytest_asyncio.fixture(scope="module")
async def pair(ipc_dir: Path) -> AsyncIterator[list[EmulatedEngine]]:
    engines = [
        await start_test_engine(
            engine_id=f"adm{i}",
            kv_events_endpoint=f"ipc://{ipc_dir}/adm{i}",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
            dp_size=2 if i == 1 else 1,
        )
        for i in range(2)
    ]
    yield engines
    for engine in engines:
        await engine.stop()


@pytest_asyncio.fixture
async def router(pair: list[EmulatedEngine]) -> AsyncIterator[RouterApp]:
    app = await start_router([pair[0].url, {"url": pair[1].url, "dp_size": 2}])
    yield app
    await app.stop()


def endpoint(engine: EmulatedEngine) -> str:
    return f"127.0.0.1:{engine.port}"


async def call(
    http: aiohttp.ClientSession, method: str, url: str, body: bytes | None = None
) -> tuple[int, dict]:
    async with http.request(method, url, data=body) as resp:
        return resp.status, json.loads(await resp.read())


async def test_engines_show_state_load_and_index_share(
    router: RouterApp, pair: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    await poll(lambda: router.subscriber and router.subscriber.stats.replays["ok"] >= 3)
    for engine in pair:
        await post(http, f"{engine.url}/reset_prefix_cache", {})
    prompt = " ".join(f"share{i}" for i in range(320))
    status, _ = await post(
        http, f"{pair[0].url}/v1/completions", {"prompt": prompt, "max_tokens": 1}
    )
    assert status == 200
    await poll(lambda: router.ingestor.counters.blocks_stored >= 320 // 16)
    status, answer = await call(http, "GET", f"{router.url}/admin/engines")
    assert status == 200
    by_endpoint = {e["endpoint"]: e for e in answer["engines"]}
    first, second = by_endpoint[endpoint(pair[0])], by_endpoint[endpoint(pair[1])]
    assert first["url"] == pair[0].url and first["role"] == "both"
    assert first["state"] == "healthy" and first["models"] == ["kvroute-emulated"]
    assert first["index_blocks"] == 320 // 16 and first["index_share"] == 1.0
    assert second["index_blocks"] == 0 and second["index_share"] == 0.0
    assert [r["rank"] for r in second["ranks"]] == [0, 1]
    assert first["inflight_requests"] == 0


async def test_engines_are_added_drained_and_removed(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    extra = await start_test_engine(engine_id="adm-extra")
    base = f"{router.url}/admin/engines"
    try:
        body = json.dumps({"url": extra.url, "role": "decode", "kv_events": "none"}).encode()
        status, added = await call(http, "POST", base, body)
        assert status == 201 and added["endpoint"] == endpoint(extra) and added["role"] == "decode"
        await poll(lambda: router.registry.get(endpoint(extra)).state.value == "healthy")
        status, drained = await call(http, "POST", f"{base}/{endpoint(extra)}/drain")
        assert status == 200 and drained["state"] == "draining"
        assert router.registry.get(endpoint(extra)).state.value == "draining"
        status, undrained = await call(http, "POST", f"{base}/{endpoint(extra)}/undrain")
        assert status == 200 and undrained["state"] == "healthy"
        status, removed = await call(http, "DELETE", f"{base}/{endpoint(extra)}")
        assert status == 200 and removed["state"] == "removed"
        assert router.registry.get(endpoint(extra)) is None
    finally:
        await extra.stop()


async def test_an_engine_added_with_its_topology_lists_it_back(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    extra = await start_test_engine(engine_id="adm-topo")
    base = f"{router.url}/admin/engines"
    try:
        where = {"node": "gpu-7", "rack": "r2", "zone": "z1"}
        body = json.dumps({"url": extra.url, "kv_events": "none", "topology": where}).encode()
        status, added = await call(http, "POST", base, body)
        assert status == 201 and added["topology"] == where
        assert router.registry.get(endpoint(extra)).topology == Topology("gpu-7", "r2", "z1")
        status, listed = await call(http, "GET", base)
        assert status == 200
        others = [e["topology"] for e in listed["engines"] if e["endpoint"] != endpoint(extra)]
        assert others and all(t is None for t in others)  # configured without any
        bad = json.dumps({"url": extra.url, "topology": {"row": "3"}}).encode()
        status, answer = await call(http, "POST", base, bad)
        assert status == 400 and "row" in answer["error"]["message"]
    finally:
        await call(http, "DELETE", f"{base}/{endpoint(extra)}")
        await extra.stop()


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "needle"),
    [
        ("POST", "", b"{not json", 400, "JSON"),
        ("POST", "", b"[1]", 400, "object"),
        ("POST", "", b'{"url": "ftp://x"}', 400, "url"),
        ("POST", "", b'{"url": "http://127.0.0.1:9/v1"}', 400, "has a path"),
        ("POST", "", b'{"url": "http://127.0.0.1:9", "dp_size": 0}', 400, "dp_size"),
        ("POST", "", b'{"url": "http://127.0.0.1:9", "colour": "red"}', 400, "colour"),
        ("DELETE", "/127.0.0.1:1", None, 404, "127.0.0.1:1"),
        ("POST", "/127.0.0.1:1/drain", None, 404, "known engines"),
        ("POST", "/127.0.0.1:1/undrain", None, 404, "known engines"),
        ("PUT", "", b"{}", 404, "not supported"),
    ],
)
async def test_bad_admin_calls_get_openai_errors(
    router: RouterApp,
    http: aiohttp.ClientSession,
    method: str,
    path: str,
    body: bytes | None,
    status: int,
    needle: str,
) -> None:
    got, answer = await call(http, method, f"{router.url}/admin/engines{path}", body)
    assert got == status
    assert needle in answer["error"]["message"]
    assert answer["error"]["type"] in ("invalid_request_error", "not_found_error")


async def test_kvroute_status_prints_the_engines(
    router: RouterApp, pair: list[EmulatedEngine], capsys: pytest.CaptureFixture[str]
) -> None:
    # The CLI blocks on its HTTP call: run it off the loop the router serves on.
    assert await asyncio.to_thread(main, ["status", router.url, "--timeout", "30"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == [
        "ENGINE",
        "ROLE",
        "STATE",
        "MODELS",
        "INFLIGHT",
        "PREFILL_Q",
        "INDEX_BLOCKS",
        "SHARE",
        "US/TOKEN",
        "TTFT0_MS",
        "TPOT_MS",
    ]
    rows = {line.split()[0]: line.split() for line in table[1 : table.index("")]}
    assert rows[endpoint(pair[0])][1:4] == ["both", "healthy", "kvroute-emulated"]
    assert "dp1" in rows  # the DP engine shows a row per rank
    assert await asyncio.to_thread(main, ["status", router.url, "--json", "--timeout", "30"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert {e["endpoint"] for e in answer["engines"]} == {endpoint(e) for e in pair}


def run_into_a_closed_pipe(*argv: str) -> subprocess.CompletedProcess[str]:
    """``kvroute ARGV`` writing to a pipe whose reader has gone, as ``| head`` leaves it."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "router", *argv],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)


async def test_kvroute_status_into_a_closed_pipe_exits_quietly(router: RouterApp) -> None:
    done = await asyncio.to_thread(run_into_a_closed_pipe, "status", router.url, "--json")
    assert (done.returncode, done.stderr) == (1, "")


async def test_kvroute_status_says_why_it_cannot_read(capsys: pytest.CaptureFixture[str]) -> None:
    assert await asyncio.to_thread(main, ["status", "http://127.0.0.1:9", "--timeout", "2"]) == 1
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err


async def test_kvroute_status_takes_host_and_port(
    router: RouterApp, pair: list[EmulatedEngine], capsys: pytest.CaptureFixture[str]
) -> None:
    address = router.url.removeprefix("http://")
    assert await asyncio.to_thread(main, ["status", address, "--timeout", "30"]) == 0
    assert endpoint(pair[0]) in capsys.readouterr().out


async def test_kvroute_status_against_an_engine_says_it_is_not_a_router(
    pair: list[EmulatedEngine], capsys: pytest.CaptureFixture[str]
) -> None:
    assert await asyncio.to_thread(main, ["status", pair[0].url, "--timeout", "30"]) == 1
    err = capsys.readouterr().err
    assert f"{pair[0].url} is not a kvroute router" in err
    assert "404" not in err.replace(pair[0].url, "")  # the status, not a port like 34047
