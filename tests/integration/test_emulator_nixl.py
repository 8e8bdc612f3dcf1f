"""vLLM NixlConnector handoffs between emulated engines, over real HTTP and side channels."""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from support.clients import metric_sum, metrics, post, post_reply, stream_reply
from support.engines import TEST_PARAMS, poll, start_test_engine

from router.emulator import EmulatedEngine

#: What vLLM's toy proxy and kvroute send on a prefill leg.
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
#: A link of 1 kB per token at 100 kB/s: 10 ms of model time per token transferred.
SLOW_LINK = TEST_PARAMS.replace(kv_bytes_per_token=1_000, kv_transfer_bandwidth=1e5)

Params = dict[str, Any]


def text_prompt(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest_asyncio.fixture(scope="module")
async def prefill() -> AsyncIterator[EmulatedEngine]:
    """A prefill engine whose holds never expire during the tests: failed pulls leave
    their blocks held, and counts of held requests stay exact."""
    params = TEST_PARAMS.replace(kv_hold_timeout_s=1e9, num_gpu_blocks=4_096)
    engine = await start_test_engine(engine_id="prefill-a", params=params)
    yield engine
    await engine.stop()


@pytest_asyncio.fixture(scope="module")
async def strict_decode() -> AsyncIterator[EmulatedEngine]:
    """A decode engine that fails requests whose KV cannot be pulled."""
    engine = await start_test_engine(
        engine_id="decode-strict", handoff_failure="error", params=SLOW_LINK
    )
    yield engine
    await engine.stop()


@pytest_asyncio.fixture(scope="module")
async def lenient_decode() -> AsyncIterator[EmulatedEngine]:
    """A decode engine that recomputes, as vLLM does."""
    engine = await start_test_engine(engine_id="decode-lenient")
    yield engine
    await engine.stop()


async def prefill_leg(
    http: aiohttp.ClientSession, engine: EmulatedEngine, prompt: str, **extra: Any
) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": REMOTE_DECODE, **extra}
    status, answer = await post(http, f"{engine.url}/v1/completions", body)
    assert status == 200, answer
    return answer


async def held_requests(http: aiohttp.ClientSession, engine: EmulatedEngine) -> float:
    return metric_sum(await metrics(http, engine.url), "kvroute_emulator_kv_held_requests")


async def nothing_held(http: aiohttp.ClientSession, engine: EmulatedEngine) -> bool:
    return await held_requests(http, engine) == 0


async def holds_back_to(http: aiohttp.ClientSession, engine: EmulatedEngine, count: float) -> bool:
    return await held_requests(http, engine) == count


async def test_a_decode_leg_pulls_the_blocks_the_prefill_leg_holds(
    prefill: EmulatedEngine, strict_decode: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    prompt = text_prompt(200, "pull")
    held_before = await held_requests(http, prefill)
    answer = await prefill_leg(http, prefill, prompt)
    params = answer["kv_transfer_params"]
    assert answer["choices"][0]["finish_reason"] == "length"
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "prefill-a" and params["tp_size"] == 1
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] == prefill.side_channel_port
    assert len(params["remote_block_ids"]) == 1 and len(params["remote_block_ids"][0]) == 13
    assert await held_requests(http, prefill) == held_before + 1

    before = await metrics(http, strict_decode.url)
    body = {"prompt": prompt, "max_tokens": 4, "kv_transfer_params": params}
    decoded = await post_reply(http, f"{strict_decode.url}/v1/completions", body)
    assert decoded.status == 200, decoded.body
    assert decoded.headers["x-kvroute-handoff"] == "pulled=200"
    assert decoded.body["usage"]["prompt_tokens_details"]["cached_tokens"] == 199
    assert decoded.body["kv_transfer_params"] is None

    after = await metrics(http, strict_decode.url)
    pulled = "kvroute_emulator_kv_pulled_tokens_total"
    assert metric_sum(after, pulled) - metric_sum(before, pulled) == 200
    # 200 tokens over the slow link take 2 s of model time before the first token.
    ttft = "vllm:time_to_first_token_seconds_sum"
    assert metric_sum(after, ttft) - metric_sum(before, ttft) >= 2.0
    # The transfer done, the prefill engine frees the blocks.
    await poll(lambda: holds_back_to(http, prefill, held_before))
    # The same answer as without a handoff, and the KV is now the decode engine's own.
    plain_body = {"prompt": prompt, "max_tokens": 4}
    _, plain = await post(http, f"{prefill.url}/v1/completions", plain_body)
    assert decoded.body["choices"][0]["text"] == plain["choices"][0]["text"]
    _, again = await post(
        http, f"{strict_decode.url}/v1/completions", {"prompt": prompt, "max_tokens": 1}
    )
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 192


# ---------------------------------------------------------------------- failures

#: Each failure: how it spoils the params (given the engines), its reason, and a phrase
#: of the error message.
Spoil = Callable[[Params, "Engines"], Params]


class Engines:
    def __init__(self, prefill: EmulatedEngine, other_prompt: str) -> None:
        self.prefill = prefill
        self.other_prompt = other_prompt


FAILURES: dict[str, tuple[Spoil, str, str]] = {
    "unknown request": (
        lambda p, e: {**p, "remote_request_id": "no-such-request"},
        "unknown",
        "holds no KV blocks for request 'no-such-request'",
    ),
    "wrong port": (
        lambda p, e: {**p, "remote_port": free_port()},
        "unreachable",
        "cannot connect",
    ),
    "wrong host": (
        lambda p, e: {**p, "remote_host": "127.0.0.2"},
        "unreachable",
        "cannot connect",
    ),
    "the HTTP port": (
        lambda p, e: {**p, "remote_port": e.prefill.port},
        "unreachable",
        "does not speak this protocol",
    ),
    "wrong engine": (
        lambda p, e: {**p, "remote_engine_id": "prefill-b"},
        "engine_mismatch",
        "serves engine 'prefill-a', not 'prefill-b'",
    ),
    "wrong blocks": (
        lambda p, e: {**p, "remote_block_ids": [[b + 1 for b in p["remote_block_ids"][0]]]},
        "block_mismatch",
        "holds blocks",
    ),
    "missing field": (
        lambda p, e: {k: v for k, v in p.items() if k != "remote_request_id"},
        "invalid_params",
        "missing remote_request_id",
    ),
}


async def spoiled_params(
    http: aiohttp.ClientSession, prefill: EmulatedEngine, prompt: str, case: str
) -> Params:
    params = (await prefill_leg(http, prefill, prompt))["kv_transfer_params"]
    spoil = FAILURES[case][0]
    return spoil(params, Engines(prefill, prompt))


@pytest.mark.parametrize("case", list(FAILURES))
async def test_unusable_params_fail_the_decode_leg_in_error_mode(
    case: str,
    prefill: EmulatedEngine,
    strict_decode: EmulatedEngine,
    http: aiohttp.ClientSession,
) -> None:
    _, reason, phrase = FAILURES[case]
    prompt = text_prompt(64, f"err-{case.replace(' ', '-')}")
    params = await spoiled_params(http, prefill, prompt, case)
    body = {"prompt": prompt, "max_tokens": 4, "kv_transfer_params": params}
    reply = await post_reply(http, f"{strict_decode.url}/v1/completions", body)
    assert reply.status == 500
    assert reply.body["error"]["type"] == "InternalServerError"
    assert phrase in reply.body["error"]["message"]
    assert reply.headers["x-kvroute-handoff"] == f"failed={reason}"
    samples = await metrics(http, strict_decode.url)
    failures = "kvroute_emulator_handoff_failures_total"
    assert metric_sum(samples, failures, dialect="nixl", reason=reason) >= 1


@pytest.mark.parametrize("case", list(FAILURES))
async def test_unusable_params_are_recomputed_in_recompute_mode(
    case: str,
    prefill: EmulatedEngine,
    lenient_decode: EmulatedEngine,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    prompt = text_prompt(64, f"rec-{case.replace(' ', '-')}")
    params = await spoiled_params(http, prefill, prompt, case)
    before = await metrics(http, lenient_decode.url)
    body = {"prompt": prompt, "max_tokens": 4, "kv_transfer_params": params}
    with caplog.at_level(logging.WARNING, logger="router.emulator.handoff.nixl"):
        reply = await post_reply(http, f"{lenient_decode.url}/v1/completions", body)
    assert reply.status == 200, reply.body
    assert reply.headers["x-kvroute-handoff"] == "recomputed=64"
    assert reply.body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert "recomputing the prefill locally" in caplog.text
    after = await metrics(http, lenient_decode.url)
    recomputed = "kvroute_emulator_kv_recomputed_tokens_total"
    assert metric_sum(after, recomputed) - metric_sum(before, recomputed) == 64


@pytest.mark.parametrize("mode", ["error", "recompute"])
async def test_params_that_were_already_pulled_cannot_be_pulled_again(
    mode: str,
    prefill: EmulatedEngine,
    strict_decode: EmulatedEngine,
    lenient_decode: EmulatedEngine,
    http: aiohttp.ClientSession,
) -> None:
    prompt = text_prompt(64, f"twice-{mode}")
    params = (await prefill_leg(http, prefill, prompt))["kv_transfer_params"]
    body = {"prompt": prompt, "max_tokens": 2, "kv_transfer_params": params}
    first = await post_reply(http, f"{strict_decode.url}/v1/completions", body)
    assert first.headers["x-kvroute-handoff"] == "pulled=64"
    decode = strict_decode if mode == "error" else lenient_decode
    second = await post_reply(http, f"{decode.url}/v1/completions", body)
    if mode == "error":
        assert second.status == 500
        assert "already pulled" in second.body["error"]["message"]
    else:
        assert second.status == 200
        assert second.headers["x-kvroute-handoff"] == "recomputed=64"


@pytest.mark.parametrize("mode", ["error", "recompute"])
async def test_params_whose_blocks_expired_cannot_be_pulled(
    mode: str,
    strict_decode: EmulatedEngine,
    lenient_decode: EmulatedEngine,
    http: aiohttp.ClientSession,
) -> None:
    # Held 2 model seconds: 2 ms of wall time at the tests' time scale.
    short = await start_test_engine(
        engine_id="prefill-short", params=TEST_PARAMS.replace(kv_hold_timeout_s=2.0)
    )
    try:
        prompt = text_prompt(64, f"expire-{mode}")
        params = (await prefill_leg(http, short, prompt))["kv_transfer_params"]
        # Nobody pulls: the engine's own timer frees the blocks.
        await poll(lambda: nothing_held(http, short))
        samples = await metrics(http, short.url)
        assert metric_sum(samples, "kvroute_emulator_kv_hold_expired_total") == 1
        decode = strict_decode if mode == "error" else lenient_decode
        body = {"prompt": prompt, "max_tokens": 2, "kv_transfer_params": params}
        reply = await post_reply(http, f"{decode.url}/v1/completions", body)
    finally:
        await short.stop()
    if mode == "error":
        assert reply.status == 500 and "expired" in reply.body["error"]["message"]
        assert reply.headers["x-kvroute-handoff"] == "failed=expired"
    else:
        assert reply.status == 200 and reply.headers["x-kvroute-handoff"] == "recomputed=64"


async def test_another_prompts_params_fail_without_spending_the_blocks(
    prefill: EmulatedEngine, strict_decode: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    prompt = text_prompt(64, "mine")
    params = (await prefill_leg(http, prefill, prompt))["kv_transfer_params"]
    other = {"prompt": text_prompt(64, "theirs"), "max_tokens": 2, "kv_transfer_params": params}
    wrong = await post_reply(http, f"{strict_decode.url}/v1/completions", other)
    assert wrong.status == 500 and "another prompt" in wrong.body["error"]["message"]
    assert wrong.headers["x-kvroute-handoff"] == "failed=prompt_mismatch"
    # The right decode leg still finds the blocks.
    mine = {"prompt": prompt, "max_tokens": 2, "kv_transfer_params": params}
    right = await post_reply(http, f"{strict_decode.url}/v1/completions", mine)
    assert right.headers["x-kvroute-handoff"] == "pulled=64"


async def test_a_streamed_decode_leg_reports_a_failed_pull_as_an_error_event(
    prefill: EmulatedEngine, strict_decode: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    prompt = text_prompt(64, "stream-fail")
    params = await spoiled_params(http, prefill, prompt, "unknown request")
    body = {"prompt": prompt, "max_tokens": 4, "stream": True, "kv_transfer_params": params}
    reply = await stream_reply(http, f"{strict_decode.url}/v1/completions", body)
    error, done = reply.body
    assert error["error"]["code"] == 500 and "holds no KV blocks" in error["error"]["message"]
    assert done == "[DONE]"
    # As vLLM's, the stream's headers went out before the pull: they say nothing of it.
    assert "x-kvroute-handoff" not in reply.headers


async def test_a_streamed_chat_decode_leg_pulls_and_its_usage_shows_it(
    prefill: EmulatedEngine, strict_decode: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    messages = [{"role": "user", "content": text_prompt(100, "chat")}]
    leg = {"messages": messages, "max_tokens": 1, "kv_transfer_params": REMOTE_DECODE}
    _, answer = await post(http, f"{prefill.url}/v1/chat/completions", leg)
    body = {
        "messages": messages,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": answer["kv_transfer_params"],
    }
    pulled = "kvroute_emulator_kv_pulled_tokens_total"
    before = metric_sum(await metrics(http, strict_decode.url), pulled)
    reply = await stream_reply(http, f"{strict_decode.url}/v1/chat/completions", body)
    usage = reply.body[-2]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert reply.body[-1] == "[DONE]"
    after = metric_sum(await metrics(http, strict_decode.url), pulled)
    assert after - before == usage["prompt_tokens"]


async def test_a_prefill_leg_stopped_by_a_stop_token_gives_no_params(
    prefill: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    prompt = text_prompt(64, "stopped")
    _, plain = await post(
        http, f"{prefill.url}/v1/completions", {"prompt": prompt, "max_tokens": 1}
    )
    (first,) = plain["choices"][0]["text"].split()
    _, tokens = await post(http, f"{prefill.url}/tokenize", {"prompt": first})
    held_before = await held_requests(http, prefill)
    answer = await prefill_leg(http, prefill, prompt, stop_token_ids=tokens["tokens"])
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["choices"][0]["stop_reason"] == tokens["tokens"][0]
    assert answer["kv_transfer_params"] is None
    assert await held_requests(http, prefill) == held_before


async def test_handoff_requests_take_one_sequence_and_one_direction(
    prefill: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    url = f"{prefill.url}/v1/completions"
    both = {**REMOTE_DECODE, "do_remote_prefill": True}
    for body in (
        {"prompt": "a b c", "n": 2, "kv_transfer_params": REMOTE_DECODE},
        {"prompt": ["a b", "c d"], "kv_transfer_params": REMOTE_DECODE},
        {"prompt": "a b c", "kv_transfer_params": both},
        {"prompt": "a b c", "kv_transfer_params": "yes"},
    ):
        status, answer = await post(http, url, body)
        assert status == 400, (body, answer)
