"""SGLang bootstrap handoffs: both legs at once, paired by room, over real sockets."""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from support.clients import Reply, metric_sum, metrics, post, post_reply, stream_reply
from support.engines import TEST_PARAMS, poll, start_test_engine

from router.emulator import EmulatedEngine


def text_prompt(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest_asyncio.fixture(scope="module")
async def pair() -> AsyncIterator[tuple[EmulatedEngine, EmulatedEngine]]:
    """A prefill and a decode engine with a generous bootstrap timeout, and a prefill hold
    that outlasts a loaded machine (480 model seconds are 0.48 s at the tests' clock: a
    hundred pairs at once on 2 busy cores took longer to be pulled)."""
    params = TEST_PARAMS.replace(kv_hold_timeout_s=60_000.0)
    prefill = await start_test_engine(
        engine_id="sg-p", role="prefill", bootstrap_timeout_s=30, params=params
    )
    decode = await start_test_engine(
        engine_id="sg-d", role="decode", bootstrap_timeout_s=30, params=params
    )
    yield prefill, decode
    await decode.stop()
    await prefill.stop()


@pytest_asyncio.fixture(scope="module")
async def impatient() -> AsyncIterator[tuple[EmulatedEngine, EmulatedEngine]]:
    """A pair whose legs wait only 0.3 s for each other."""
    prefill = await start_test_engine(engine_id="sg-p2", role="prefill", bootstrap_timeout_s=0.3)
    decode = await start_test_engine(engine_id="sg-d2", role="decode", bootstrap_timeout_s=0.3)
    yield prefill, decode
    await decode.stop()
    await prefill.stop()


@pytest_asyncio.fixture
async def unlimited() -> AsyncIterator[aiohttp.ClientSession]:
    """A client without a connection limit: a prefill leg holds its connection until its
    decode leg arrives, so a pool smaller than all legs could wait on itself."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        yield session


def bootstrap(prefill: EmulatedEngine, room: int, **changes: Any) -> dict[str, Any]:
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port}
    return {**fields, "bootstrap_room": room, **changes}


async def both_legs(
    http: aiohttp.ClientSession,
    prefill: EmulatedEngine,
    decode: EmulatedEngine,
    prefill_body: dict[str, Any],
    decode_body: dict[str, Any],
) -> tuple[Reply, Reply]:
    p, d = await asyncio.gather(
        post_reply(http, f"{prefill.url}/v1/completions", prefill_body),
        post_reply(http, f"{decode.url}/v1/completions", decode_body),
    )
    return p, d


async def nothing_held(http: aiohttp.ClientSession, engine: EmulatedEngine) -> bool:
    samples = await metrics(http, engine.url)
    return metric_sum(samples, "kvroute_emulator_kv_held_requests") == 0


async def test_a_hundred_concurrent_pairs_never_mix_rooms(
    pair: tuple[EmulatedEngine, EmulatedEngine], unlimited: aiohttp.ClientSession
) -> None:
    prefill, decode = pair
    rng = random.Random(7)
    # Each prompt has its own length: a decode leg reporting another's would show.
    prompts = [text_prompt(40 + i, f"room{i}-") for i in range(100)]
    rooms = [rng.getrandbits(63) for _ in range(100)]

    async def run(i: int) -> tuple[Reply, Reply]:
        body = {"prompt": prompts[i], "max_tokens": 3, **bootstrap(prefill, rooms[i])}
        return await both_legs(unlimited, prefill, decode, body, body)

    results = await asyncio.gather(*(run(i) for i in range(100)))
    for i, (p, d) in enumerate(results):
        assert p.status == 200 and d.status == 200, (p.body, d.body)
        assert len(p.body["choices"][0]["text"].split()) == 1  # a prefill leg makes one token
        assert d.headers["x-kvroute-handoff"] == f"pulled={40 + i}"
        assert d.body["usage"]["prompt_tokens_details"]["cached_tokens"] == 40 + i - 1
    samples = await metrics(unlimited, decode.url)
    assert metric_sum(samples, "kvroute_emulator_kv_pulled_tokens_total") >= sum(
        40 + i for i in range(100)
    )
    # Every decode leg answered exactly what an engine answers its prompt alone.
    for i in rng.sample(range(100), 10):
        _, alone = await post(
            unlimited, f"{prefill.url}/v1/completions", {"prompt": prompts[i], "max_tokens": 3}
        )
        assert results[i][1].body["choices"][0]["text"] == alone["choices"][0]["text"]
    await poll(lambda: nothing_held(unlimited, prefill))


async def test_a_streamed_decode_leg_pulls(
    pair: tuple[EmulatedEngine, EmulatedEngine], unlimited: aiohttp.ClientSession
) -> None:
    prefill, decode = pair
    body = {"prompt": text_prompt(90, "streamed"), "max_tokens": 2, **bootstrap(prefill, 11)}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    p, d = await asyncio.gather(
        post_reply(unlimited, f"{prefill.url}/v1/completions", body),
        stream_reply(unlimited, f"{decode.url}/v1/completions", streamed),
    )
    assert p.status == 200 and d.body[-1] == "[DONE]"
    assert d.body[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 89


async def test_legs_of_different_rooms_both_fail_clearly(
    impatient: tuple[EmulatedEngine, EmulatedEngine], unlimited: aiohttp.ClientSession
) -> None:
    prefill, decode = impatient
    body = {"prompt": text_prompt(30, "rooms"), "max_tokens": 2}
    p, d = await both_legs(
        unlimited,
        prefill,
        decode,
        {**body, **bootstrap(prefill, 1001)},
        {**body, **bootstrap(prefill, 1002)},
    )
    assert p.status == 500 and d.status == 500
    assert "no decode engine joined bootstrap room 1001" in p.body["error"]["message"]
    assert "no prefill request with bootstrap_room 1002" in d.body["error"]["message"]
    assert p.headers["x-kvroute-handoff"] == "failed=no_decode"
    assert d.headers["x-kvroute-handoff"] == "failed=no_prefill"


@pytest.mark.parametrize(
    ("where", "phrase"),
    [
        ("nothing listening", "cannot connect"),
        ("another host", "cannot connect"),
        ("the HTTP port", "does not speak this protocol"),
        ("no port", "needs bootstrap_host and bootstrap_port"),
    ],
)
async def test_a_decode_leg_sent_to_a_wrong_bootstrap_address_fails_at_once(
    where: str,
    phrase: str,
    impatient: tuple[EmulatedEngine, EmulatedEngine],
    unlimited: aiohttp.ClientSession,
) -> None:
    prefill, decode = impatient
    changes: dict[str, Any] = {
        "nothing listening": {"bootstrap_port": free_port()},
        "another host": {"bootstrap_host": "127.0.0.2"},
        "the HTTP port": {"bootstrap_port": prefill.port},
        "no port": {"bootstrap_port": None},
    }[where]
    body = {"prompt": "a b c", "max_tokens": 2, **bootstrap(prefill, 5, **changes)}
    reply = await post_reply(unlimited, f"{decode.url}/v1/completions", body)
    assert reply.status == 500 and phrase in reply.body["error"]["message"]


async def test_legs_of_different_prompts_in_one_room_fail_the_decode_leg(
    pair: tuple[EmulatedEngine, EmulatedEngine], unlimited: aiohttp.ClientSession
) -> None:
    prefill, decode = pair
    room = bootstrap(prefill, 2024)
    p, d = await both_legs(
        unlimited,
        prefill,
        decode,
        {"prompt": text_prompt(30, "mine"), "max_tokens": 1, **room},
        {"prompt": text_prompt(30, "theirs"), "max_tokens": 1, **room},
    )
    assert p.status == 200
    assert d.status == 500 and "another prompt" in d.body["error"]["message"]
    await poll(lambda: nothing_held(unlimited, prefill))


async def test_a_room_serves_one_prefill_request(
    pair: tuple[EmulatedEngine, EmulatedEngine], unlimited: aiohttp.ClientSession
) -> None:
    prefill, decode = pair
    body = {"prompt": text_prompt(20, "dup"), "max_tokens": 1, **bootstrap(prefill, 77)}
    first = asyncio.ensure_future(post_reply(unlimited, f"{prefill.url}/v1/completions", body))
    # Wait until the first prefill leg holds the room, then send a second one.
    await poll(lambda: prefill.state.rooms is not None and len(prefill.state.rooms) == 1)
    second = await post_reply(unlimited, f"{prefill.url}/v1/completions", body)
    assert second.status == 500 and "already used" in second.body["error"]["message"]
    decoded = await post_reply(unlimited, f"{decode.url}/v1/completions", body)
    assert decoded.status == 200 and (await first).status == 200


async def test_a_decode_leg_that_leaves_while_waiting_frees_the_room(
    pair: tuple[EmulatedEngine, EmulatedEngine], unlimited: aiohttp.ClientSession
) -> None:
    prefill, decode = pair
    body = {"prompt": text_prompt(50, "leaver"), "max_tokens": 4, **bootstrap(prefill, 99)}
    aborted = "kvroute_emulator_aborted_requests_total"
    before = metric_sum(await metrics(unlimited, decode.url), aborted)
    leaving = asyncio.ensure_future(post_reply(unlimited, f"{decode.url}/v1/completions", body))
    await poll(lambda: prefill.state.rooms is not None and len(prefill.state.rooms) == 1)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving

    async def counted() -> bool:
        samples = await metrics(unlimited, decode.url)
        return metric_sum(samples, aborted) == before + 1

    await poll(counted)
    # The prefill leg still runs (the decode engine had joined), and its blocks are freed.
    reply = await post_reply(unlimited, f"{prefill.url}/v1/completions", body)
    assert reply.status == 200
    await poll(lambda: nothing_held(unlimited, prefill))
    assert prefill.state.rooms is not None and len(prefill.state.rooms) == 0


async def test_an_engine_of_role_both_ignores_bootstrap_fields(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    body = {"prompt": "a b c", "max_tokens": 2, "bootstrap_room": 3, "bootstrap_port": 1}
    reply = await post_reply(http, f"{engine.url}/v1/completions", body)
    assert reply.status == 200 and "x-kvroute-handoff" not in reply.headers
