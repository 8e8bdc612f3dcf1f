"""``kvroute engine`` as separate processes on loopback (the flags wired end to end):
NIXL and SGLang handoffs between two processes, with the decode side's counters showing
the pulled tokens, and DP ranks of one process with their own caches and KV-event endpoints."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import aiohttp
import pytest
from support.clients import get, metric_sum, metrics, post, post_reply
from support.engines import EngineProcess, poll

COMMON = ["--port", "0", "--cache-blocks", "512", "--time-scale", "0.001", "--hash-seed", "1"]
PULLED = "kvroute_emulator_kv_pulled_tokens_total"
HELD = "kvroute_emulator_kv_held_requests"
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


@pytest.fixture
def processes() -> Iterator[list[EngineProcess]]:
    started: list[EngineProcess] = []
    yield started
    for proc in started:
        proc.stop()


async def test_a_nixl_handoff_between_processes_shows_in_the_decode_counters(
    processes: list[EngineProcess], http: aiohttp.ClientSession
) -> None:
    prefill = EngineProcess([*COMMON, "--engine-id", "p0", "--side-channel-port", "0"])
    processes.append(prefill)
    decode = EngineProcess([*COMMON, "--engine-id", "d0", "--handoff-failure", "error"])
    processes.append(decode)
    assert "side-channel 127.0.0.1:" in prefill.line
    _, info = await get(http, f"{prefill.url}/server_info")
    before = metric_sum(await metrics(http, decode.url), PULLED)
    prompt = words(250, "nixl")
    body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": REMOTE_DECODE}
    status, answer = await post(http, f"{prefill.url}/v1/completions", body)
    assert status == 200
    params = answer["kv_transfer_params"]
    assert params["remote_port"] == info["side_channel_port"]  # the side channel, not HTTP
    assert metric_sum(await metrics(http, prefill.url), HELD) == 1
    body = {"prompt": prompt, "max_tokens": 3, "kv_transfer_params": params}
    reply = await post_reply(http, f"{decode.url}/v1/completions", body)
    assert reply.status == 200 and reply.headers["x-kvroute-handoff"] == "pulled=250"
    assert reply.body["usage"]["prompt_tokens_details"]["cached_tokens"] == 249
    assert metric_sum(await metrics(http, decode.url), PULLED) - before == 250

    async def released() -> bool:
        return metric_sum(await metrics(http, prefill.url), HELD) == 0

    await poll(released)
    # Pulled once: a second pull of the same params fails in error mode.
    again = await post_reply(http, f"{decode.url}/v1/completions", body)
    assert again.status == 500 and again.headers["x-kvroute-handoff"] == "failed=already_pulled"


async def test_sglang_pairs_between_processes_never_mix_rooms(
    processes: list[EngineProcess],
) -> None:
    # A hold of 60 wall seconds (virtual ones pass 1000 times faster): 100 pairs at once
    # on a busy machine may take longer than the default's half second to pull.
    hold = ["--kv-hold-timeout", "60000"]
    prefill = EngineProcess([*COMMON, *hold, "--role", "prefill", "--engine-id", "sp"])
    processes.append(prefill)
    decode = EngineProcess([*COMMON, *hold, "--role", "decode", "--engine-id", "sd"])
    processes.append(decode)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=60)
    ) as http:
        _, info = await get(http, f"{prefill.url}/server_info")
        port = info["bootstrap_port"]
        rng = random.Random(11)
        rooms = [rng.getrandbits(63) for _ in range(100)]

        async def pair(i: int) -> tuple[int, int, str]:
            body = {
                "prompt": words(30 + i, f"r{i}-"),
                "max_tokens": 2,
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": port,
                "bootstrap_room": rooms[i],
            }
            p, d = await asyncio.gather(
                post_reply(http, f"{prefill.url}/v1/completions", body),
                post_reply(http, f"{decode.url}/v1/completions", body),
            )
            return p.status, d.status, d.headers.get("x-kvroute-handoff", "")

        results = await asyncio.gather(*(pair(i) for i in range(100)))
        for i, (p_status, d_status, handoff) in enumerate(results):
            assert (p_status, d_status, handoff) == (200, 200, f"pulled={30 + i}")
        pulled = metric_sum(await metrics(http, decode.url), PULLED)
        assert pulled == sum(30 + i for i in range(100))


async def test_dp_ranks_of_one_process_keep_separate_caches_and_event_endpoints(
    processes: list[EngineProcess], http: aiohttp.ClientSession
) -> None:
    proc = EngineProcess(
        [
            *COMMON,
            "--dp-size",
            "2",
            "--kv-events-endpoint",
            "tcp://127.0.0.1:*",
            "--kv-events-replay-endpoint",
            "tcp://127.0.0.1:*",
        ]
    )
    processes.append(proc)
    _, info = await get(http, f"{proc.url}/server_info")
    endpoints = [r["kv_events_endpoint"] for r in info["ranks"]]
    assert len(set(endpoints)) == 2
    prompt = words(100, "dp")

    async def cached(rank: int) -> int:
        status, answer = await post(
            http,
            f"{proc.url}/v1/completions",
            {"prompt": prompt, "max_tokens": 1},
            {"X-data-parallel-rank": str(rank)},
        )
        assert status == 200
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert [await cached(0), await cached(0), await cached(1), await cached(1)] == [0, 96, 0, 96]
