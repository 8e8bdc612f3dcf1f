"""The kvroute.v1 gRPC API with real grpc.aio clients on loopback, in front of emulated
engines: Pick decides as the HTTP API does, Generate runs the HTTP API's path, Release
and expiry keep load true, errors are status codes, health follows draining."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio
from grpc import aio
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support.clients import metric_sum, metrics, post, post_reply, session
from support.engines import poll, start_test_engine
from support.grpc_clients import (
    connect,
    generate,
    health_status,
    rpc_error,
    streamed_text,
)
from support.routers import start_router

from router.app import RouterApp
from router.emulator import EmulatedEngine
from router.grpc.gen.kvroute.v1 import router_pb2 as pb
from router.process import ServerProcess
from router.topology import Topology

LONG = 2000


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


@pytest_asyncio.fixture(scope="module")
async def fleet(ipc_dir: Path) -> AsyncIterator[list[EmulatedEngine]]:
    engines = [
        await start_test_engine(
            engine_id=f"grpc{i}",
            kv_events_endpoint=f"ipc://{ipc_dir}/grpc{i}",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
        )
        for i in range(3)
    ]
    yield engines
    for engine in engines:
        await engine.stop()


@pytest_asyncio.fixture(scope="module")
async def pools(ipc_dir: Path) -> AsyncIterator[dict[str, list[EmulatedEngine]]]:
    def events(name: str) -> dict[str, str]:
        return {
            "kv_events_endpoint": f"ipc://{ipc_dir}/{name}",
            "kv_events_replay_endpoint": "tcp://127.0.0.1:*",
        }

    prefill = [
        await start_test_engine(engine_id=f"gp{i}", role="prefill", **events(f"gp{i}"))
        for i in range(2)
    ]
    decode = [
        await start_test_engine(
            engine_id=f"gd{i}", role="decode", handoff_failure="error", **events(f"gd{i}")
        )
        for i in range(2)
    ]
    yield {"prefill": prefill, "decode": decode}
    for engine in prefill + decode:
        await engine.stop()


async def reset(http: aiohttp.ClientSession, engines: list[EmulatedEngine]) -> None:
    for engine in engines:
        status, _ = await post(http, f"{engine.url}/reset_prefix_cache", {})
        assert status == 200


@pytest_asyncio.fixture
async def router(fleet: list[EmulatedEngine]) -> AsyncIterator[RouterApp]:
    app = await start_router([e.url for e in fleet], grpc={"port": 0})
    yield app
    await app.stop()


def pd_urls(pools: dict[str, list[EmulatedEngine]]) -> list[dict[str, str]]:
    return [{"url": e.url, "role": "prefill"} for e in pools["prefill"]] + [
        {"url": e.url, "role": "decode"} for e in pools["decode"]
    ]


async def synced(*apps: RouterApp, engines: int) -> None:
    for app in apps:
        await poll(lambda app=app: app.subscriber and app.subscriber.stats.replays["ok"] >= engines)


async def same_events(*apps: RouterApp) -> None:
    """Wait until the routers have applied the same KV events (the previous request's
    reached them at their own pace): the same counts at two looks in a row."""
    previous: list[tuple[object, ...]] = []

    async def agreed() -> bool:
        counts = [
            (
                app.ingestor.counters.blocks_stored,
                app.ingestor.counters.blocks_removed,
                *sorted(app.ingestor.counters.events.items()),
            )
            for app in apps
        ]
        steady = counts == previous
        previous[:] = counts
        return steady and len(set(counts)) == 1

    await poll(agreed, interval=0.05)


# --------------------------------------------------------------------------- Pick


async def test_pick_agrees_with_the_http_path_for_the_same_prompt_request_id_and_state(
    fleet: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    """Two routers in the same state (the same engines' KV events, nothing routed yet):
    one asked over gRPC, one over HTTP, request by request."""
    await reset(http, fleet)
    # Engines 1 and 2 hold a prefix each, learnt by both routers from KV events.
    for engine, tag in ((fleet[1], "alpha"), (fleet[2], "beta")):
        status, _ = await post(
            http, f"{engine.url}/v1/completions", {"prompt": words(tag, 640), "max_tokens": 1}
        )
        assert status == 200
    via_grpc = await start_router([e.url for e in fleet], grpc={"port": 0})
    via_http = await start_router([e.url for e in fleet])
    try:
        await synced(via_grpc, via_http, engines=3)
        for app in (via_grpc, via_http):
            await poll(lambda app=app: app.ingestor.counters.blocks_stored >= 2 * 640 // 16)
        bodies = [
            {"prompt": words("alpha", 640) + " one", "max_tokens": 2},
            {"prompt": words("beta", 640) + " two", "max_tokens": 2},
            {"prompt": words("gamma", 300), "max_tokens": 2},
            {"prompt": words("gamma", 300) + " again", "max_tokens": 2},
            {"messages": [{"role": "user", "content": words("delta", 50)}], "max_tokens": 2},
            {"prompt": "short", "max_tokens": 2},
        ]
        seen = set()
        async with connect(via_grpc.grpc_port) as stubs:
            for i, body in enumerate(bodies):
                rid = f"agree-{i}"
                await same_events(via_grpc, via_http)
                pick = await stubs.router.Pick(
                    pb.PickRequest(request_id=rid, body=json.dumps(body).encode())
                )
                await stubs.router.Release(pb.ReleaseRequest(request_id=rid))
                path = "chat/completions" if "messages" in body else "completions"
                reply = await post_reply(
                    http, f"{via_http.url}/v1/{path}", body, headers={"x-request-id": rid}
                )
                assert reply.status == 200, reply.body
                assert pick.mode == pb.MODE_AGGREGATED
                assert pick.decode.endpoint == reply.headers["x-kvroute-engine"], (i, body)
                assert pick.decode.decision.summary == reply.headers["x-kvroute-reason"]
                seen.add(pick.decode.endpoint)
        # The prompts with a cached prefix went to the engine holding it.
        assert len(seen) >= 2
    finally:
        await via_grpc.stop()
        await via_http.stop()


async def test_pick_agrees_with_the_http_path_on_disaggregated_pools(
    pools: dict[str, list[EmulatedEngine]], http: aiohttp.ClientSession
) -> None:
    await reset(http, pools["prefill"] + pools["decode"])
    via_grpc = await start_router(pd_urls(pools), grpc={"port": 0})
    via_http = await start_router(pd_urls(pools))
    try:
        await synced(via_grpc, via_http, engines=4)
        bodies = [
            {"prompt": words("long", LONG), "max_tokens": 3},
            {"prompt": "a short one", "max_tokens": 3},
            {"prompt": words("long", LONG) + " more", "max_tokens": 3},
            {"prompt": words("other", LONG), "max_tokens": 3},
        ]
        modes = set()
        async with connect(via_grpc.grpc_port) as stubs:
            for i, body in enumerate(bodies):
                rid = f"pd-agree-{i}"
                await same_events(via_grpc, via_http)
                pick = await stubs.router.Pick(
                    pb.PickRequest(request_id=rid, body=json.dumps(body).encode())
                )
                await stubs.router.Release(pb.ReleaseRequest(request_id=rid))
                reply = await post_reply(
                    http, f"{via_http.url}/v1/completions", body, headers={"x-request-id": rid}
                )
                assert reply.status == 200, reply.body
                assert pick.decode.endpoint == reply.headers["x-kvroute-engine"]
                if pick.mode == pb.MODE_SPLIT:
                    assert reply.headers["x-kvroute-mode"] == "split"
                    assert pick.prefill.endpoint == reply.headers["x-kvroute-prefill"]
                    assert pick.headers["x-prefiller-host-port"] == pick.prefill.endpoint
                    assert pick.handoff.dialect == "nixl"
                    params = json.loads(pick.handoff.prefill_kv_transfer_params_json)
                    assert params["do_remote_decode"] is True
                else:
                    assert pick.mode == pb.MODE_LOCAL
                    assert reply.headers["x-kvroute-mode"] == f"local:{pick.split.reason}"
                    assert not pick.HasField("prefill")
                modes.add(pick.mode)
        assert modes == {pb.MODE_SPLIT, pb.MODE_LOCAL}
    finally:
        await via_grpc.stop()
        await via_http.stop()


async def test_pick_names_the_handoff_dialect_of_the_models_pool(
    pools: dict[str, list[EmulatedEngine]], http: aiohttp.ClientSession
) -> None:
    await reset(http, pools["prefill"] + pools["decode"])
    model = pools["prefill"][0].config.model
    app = await start_router(
        pd_urls(pools), grpc={"port": 0}, models=[{"name": model, "handoff": "sglang"}]
    )
    try:
        async with connect(app.grpc_port) as stubs:
            body = {"prompt": words("sgpick", LONG), "max_tokens": 3}
            pick = await stubs.router.Pick(
                pb.PickRequest(request_id="sg-pick", body=json.dumps(body).encode())
            )
            await stubs.router.Release(pb.ReleaseRequest(request_id="sg-pick"))
        assert pick.mode == pb.MODE_SPLIT
        assert pick.handoff.dialect == "sglang"
        prefill = app.registry.get(pick.prefill.endpoint)
        assert pick.handoff.bootstrap_port == prefill.bootstrap_port
        assert pick.handoff.bootstrap_host == "127.0.0.1"
        assert not pick.handoff.prefill_kv_transfer_params_json
    finally:
        await app.stop()


async def test_pick_explains_its_choice_and_accepts_every_prompt_form(
    router: RouterApp, fleet: list[EmulatedEngine]
) -> None:
    async with connect(router.grpc_port) as stubs:
        forms = [
            pb.PickRequest(text=words("form", 100)),
            pb.PickRequest(token_ids=pb.TokenIds(ids=list(range(100)))),
            pb.PickRequest(
                messages=pb.Messages(messages=[pb.ChatMessage(role="user", content="hi there")])
            ),
            pb.PickRequest(block_keys=pb.BlockKeys(keys=[11, 22, 33], prompt_tokens=50)),
        ]
        for request in forms:
            pick = await stubs.router.Pick(request, timeout=5)
            assert pick.decode.endpoint in {f"127.0.0.1:{e.port}" for e in fleet}
            assert pick.decode.url.startswith("http://127.0.0.1:")
            assert pick.decode.decision.policy == "latency"
            assert len(pick.decode.decision.scores) == 3
            assert len(pick.fallbacks) == 2 and pick.decode.endpoint not in pick.fallbacks
            assert pick.headers["x-request-id"] == pick.request_id
            assert pick.prompt_tokens > 0
            await stubs.router.Release(pb.ReleaseRequest(request_id=pick.request_id))
        assert router.loads.in_flight == 0


async def test_pick_honours_the_subset(router: RouterApp, fleet: list[EmulatedEngine]) -> None:
    only = f"127.0.0.1:{fleet[2].port}"
    async with connect(router.grpc_port) as stubs:
        for i in range(4):
            pick = await stubs.router.Pick(
                pb.PickRequest(text=f"subset {i}", subset=[only], request_id=f"sub-{i}")
            )
            assert pick.decode.endpoint == only
            assert list(pick.fallbacks) == []
            await stubs.router.Release(pb.ReleaseRequest(request_id=f"sub-{i}"))
        code, message = await rpc_error(
            stubs.router.Pick(pb.PickRequest(text="x", subset=["127.0.0.9:1"]))
        )
        assert code == grpc.StatusCode.UNAVAILABLE and "subset" in message


async def test_a_pick_holds_load_until_released(
    router: RouterApp, fleet: list[EmulatedEngine]
) -> None:
    async with connect(router.grpc_port) as stubs:
        pick = await stubs.router.Pick(
            pb.PickRequest(text=words("held", 200), request_id="held-1", max_tokens=64)
        )
        engine = router.registry.get(pick.decode.endpoint)
        assert engine is not None
        load = router.loads.view[engine.keys[0]]
        assert load.requests == 1 and load.prefill_tokens == 200
        # The first token arrived: the prefill is no longer queued, the request still runs.
        await stubs.router.Release(pb.ReleaseRequest(request_id="held-1", prefilled=True))
        assert load.requests == 1 and load.prefill_tokens == 0 and load.decode_blocks > 0
        # The gateway served it elsewhere: the load follows.
        other = next(f"127.0.0.1:{e.port}" for e in fleet if e.url != engine.url)
        await stubs.router.Release(
            pb.ReleaseRequest(request_id="held-1", served_endpoint=other, prefilled=True)
        )
        moved = router.loads.view[router.registry.get(other).keys[0]]
        assert load.requests == 0 and load.decode_blocks == 0
        assert moved.requests == 1 and moved.decode_blocks > 0
        answer = await stubs.router.Release(pb.ReleaseRequest(request_id="held-1"))
        assert answer.held_s > 0
        assert router.loads.in_flight == 0 and moved.requests == 0 and moved.decode_blocks == 0
        code, _ = await rpc_error(stubs.router.Release(pb.ReleaseRequest(request_id="held-1")))
        assert code == grpc.StatusCode.NOT_FOUND


async def test_a_pick_never_released_expires(
    fleet: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    app = await start_router([e.url for e in fleet], grpc={"port": 0, "pick_ttl_s": 0.2})
    try:
        async with connect(app.grpc_port) as stubs:
            await stubs.router.Pick(pb.PickRequest(text="forgotten", request_id="lost"))
            assert app.loads.in_flight == 1
            await poll(lambda: app.loads.in_flight == 0, timeout=5)
            code, _ = await rpc_error(stubs.router.Release(pb.ReleaseRequest(request_id="lost")))
            assert code == grpc.StatusCode.NOT_FOUND
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_picks_ended_total", how="expired") == 1
        assert metric_sum(samples, "kvroute_picks_total", api="grpc", mode="aggregated") == 1
        assert metric_sum(samples, "kvroute_picks_open") == 0
    finally:
        await app.stop()


async def test_bad_picks_get_status_codes_with_a_message(
    fleet: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    app = await start_router([e.url for e in fleet], grpc={"port": 0}, limits={"max_inflight": 1})
    try:
        async with connect(app.grpc_port) as stubs:
            pick = stubs.router.Pick
            cases: list[tuple[pb.PickRequest, grpc.StatusCode, str]] = [
                (pb.PickRequest(), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
                (pb.PickRequest(body=b"{not json"), grpc.StatusCode.INVALID_ARGUMENT, "JSON"),
                (
                    pb.PickRequest(token_ids=pb.TokenIds()),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "prompt",
                ),
                (
                    pb.PickRequest(text="x", request_id="bad id"),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "request_id",
                ),
                (
                    pb.PickRequest(block_keys=pb.BlockKeys(keys=[1, 2], prompt_tokens=5)),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "prompt_tokens",
                ),
                (pb.PickRequest(text="x", model="nope"), grpc.StatusCode.NOT_FOUND, "nope"),
            ]
            for request, code, needle in cases:
                got, message = await rpc_error(pick(request))
                assert got == code and needle in message, (request, got, message)
            # One pick in flight fills this router (limits.max_inflight = 1): shed.
            await pick(pb.PickRequest(text="first", request_id="only"))
            got, message = await rpc_error(pick(pb.PickRequest(text="second")))
            assert got == grpc.StatusCode.RESOURCE_EXHAUSTED and "in flight" in message
            await stubs.router.Release(pb.ReleaseRequest(request_id="only"))
            # A second open pick under one request id.
            await pick(pb.PickRequest(text="first", request_id="twice"))
            app.config.limits.max_inflight = 10
            got, message = await rpc_error(pick(pb.PickRequest(text="again", request_id="twice")))
            assert got == grpc.StatusCode.ALREADY_EXISTS and "twice" in message
            await stubs.router.Release(pb.ReleaseRequest(request_id="twice"))
            # No engine left to take it.
            for engine in app.registry:
                app.registry.drain(engine)
            got, message = await rpc_error(pick(pb.PickRequest(text="x")))
            assert got == grpc.StatusCode.UNAVAILABLE and "no healthy engine" in message
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_grpc_requests_total", method="Pick", code="OK") == 2
        assert (
            metric_sum(
                samples, "kvroute_grpc_requests_total", method="Pick", code="INVALID_ARGUMENT"
            )
            == 5
        )
    finally:
        await app.stop()


#: Small request limits, for the tests that every front end refuses what HTTP refuses.
LIMITS = {
    "max_n": 2,
    "max_prompts": 2,
    "max_sequences": 3,
    "max_prompt_tokens": 8,
    "max_output_tokens": 16,
}
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def body(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload).encode()


async def test_pick_s_own_prompt_forms_are_refused_like_a_body(
    fleet: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    """Text, token ids and block keys are mapped to a body and checked by intake like
    one (test_intake.py has every refusal; these are the forms only Pick has)."""
    app = await start_router([e.url for e in fleet], grpc={"port": 0}, limits=LIMITS)
    try:
        async with connect(app.grpc_port) as stubs:
            pick = stubs.router.Pick
            cases: list[tuple[pb.PickRequest, grpc.StatusCode, str]] = [
                (pb.PickRequest(text="x", n=3), INVALID, "'n' must be at most 2"),
                (
                    pb.PickRequest(token_ids=pb.TokenIds(ids=list(range(9)))),
                    INVALID,
                    "the prompt has 9 tokens; this router accepts at most 8",
                ),
                (pb.PickRequest(text=words("long", 9)), INVALID, "the prompt has 9 tokens"),
                (pb.PickRequest(text="x", max_tokens=17), INVALID, "'max_tokens' must be at most"),
                (
                    pb.PickRequest(text="x", model="nope"),
                    grpc.StatusCode.NOT_FOUND,
                    "The model 'nope' does not exist",
                ),
                (
                    pb.PickRequest(block_keys=pb.BlockKeys(keys=[1], prompt_tokens=16), n=3),
                    INVALID,
                    "'n' must be at most 2",
                ),
                (
                    pb.PickRequest(block_keys=pb.BlockKeys(keys=[], prompt_tokens=9)),
                    INVALID,
                    "the prompt has 9 tokens",
                ),
                (
                    pb.PickRequest(block_keys=pb.BlockKeys(keys=[1]), max_tokens=17),
                    INVALID,
                    "'max_tokens' must be at most 16",
                ),
            ]
            for request, code, needle in cases:
                got, message = await rpc_error(pick(request))
                assert got == code and needle in message, (request, got, message)
            assert app.picks.open_count == 0 and app.loads.in_flight == 0
            for request in (
                pb.PickRequest(token_ids=pb.TokenIds(ids=list(range(8))), max_tokens=16),
                pb.PickRequest(body=body({"prompt": ["a", "b"], "max_tokens": 16})),
                pb.PickRequest(text="x", n=2),
                pb.PickRequest(block_keys=pb.BlockKeys(keys=[], prompt_tokens=8), n=2),
            ):
                answer = await pick(request)
                await stubs.router.Release(pb.ReleaseRequest(request_id=answer.request_id))
        samples = await metrics(http, app.url)
        refused = metric_sum(
            samples, "kvroute_grpc_requests_total", method="Pick", code="INVALID_ARGUMENT"
        )
        assert refused == len(cases) - 1
        assert metric_sum(samples, "kvroute_grpc_requests_total", method="Pick", code="OK") == 4
    finally:
        await app.stop()


# --------------------------------------------------------------------------- Generate


async def test_generate_streams_what_the_engine_produces(
    router: RouterApp, fleet: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    body = {
        "prompt": words("gen", 80),
        "max_tokens": 12,
        "seed": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with connect(router.grpc_port) as stubs:
        out = await generate(stubs.router, body, request_id="gen-1")
    assert out.status == 200 and out.chunks > 1
    assert out.headers["content-type"] == "text/event-stream"
    assert out.headers["x-request-id"] == "gen-1"
    served = out.headers["x-kvroute-engine"]
    events = out.events()
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 12
    # The same request straight to the engine that served it streams the same text.
    engine = next(e for e in fleet if served == f"127.0.0.1:{e.port}")
    async with http.post(f"{engine.url}/v1/completions", json=body) as resp:
        direct = (await resp.read()).decode()
    direct_events = [json.loads(b[6:]) for b in direct.split("\n\n") if b.startswith("data: {")]
    assert streamed_text(events) == streamed_text(direct_events)
    assert router.loads.in_flight == 0


async def test_generate_without_streaming_returns_the_whole_answer(router: RouterApp) -> None:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    async with connect(router.grpc_port) as stubs:
        out = await generate(stubs.router, body, endpoint=pb.ENDPOINT_CHAT_COMPLETIONS)
    assert out.status == 200 and out.chunks == 1
    answer = json.loads(out.data)
    assert answer["object"] == "chat.completion"
    assert answer["usage"]["completion_tokens"] == 4


async def test_generate_runs_the_disaggregated_handoff(
    pools: dict[str, list[EmulatedEngine]], http: aiohttp.ClientSession
) -> None:
    await reset(http, pools["prefill"] + pools["decode"])
    app = await start_router(pd_urls(pools), grpc={"port": 0})
    try:
        body = {"prompt": words("pdgen", LONG), "max_tokens": 5, "stream": True}
        async with connect(app.grpc_port) as stubs:
            out = await generate(stubs.router, body)
        assert out.status == 200
        assert out.headers["x-kvroute-mode"] == "split"
        assert out.headers["x-kvroute-prefill"] in {f"127.0.0.1:{e.port}" for e in pools["prefill"]}
        events = out.events()
        assert events[-1] == "[DONE]"
        assert len(streamed_text(events).split()) == 5
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_handoffs_total", dialect="nixl", outcome="pulled") == 1
    finally:
        await app.stop()


async def test_cancelling_generate_aborts_the_engines_request(
    http: aiohttp.ClientSession,
) -> None:
    slow = await start_test_engine(engine_id="grpc-slow", time_scale=0.05)
    app = await start_router([slow.url], grpc={"port": 0})
    aborted = "kvroute_emulator_aborted_requests_total"
    try:
        before = metric_sum(await metrics(http, slow.url), aborted)
        body = {"prompt": "leave early", "max_tokens": 5_000, "stream": True}
        async with connect(app.grpc_port) as stubs:
            call = stubs.router.Generate(pb.GenerateRequest(body=json.dumps(body).encode()))
            first = await call.read()
            assert first.status == 200 and first.data.startswith(b"data: ")
            assert app.loads.in_flight == 1
            call.cancel()

        async def counted() -> bool:
            return metric_sum(await metrics(http, slow.url), aborted) == before + 1

        await poll(counted)
        await poll(lambda: app.loads.in_flight == 0)
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_requests_total", outcome="cancelled") == 1
    finally:
        await app.stop()
        await slow.stop()


async def test_bad_generate_calls_get_status_codes(router: RouterApp) -> None:
    async with connect(router.grpc_port) as stubs:
        cases: list[tuple[pb.GenerateRequest, grpc.StatusCode, str]] = [
            (pb.GenerateRequest(body=b"[1, 2"), grpc.StatusCode.INVALID_ARGUMENT, "JSON"),
            (
                pb.GenerateRequest(body=b'{"prompt": "x", "model": "nope"}'),
                grpc.StatusCode.NOT_FOUND,
                "nope",
            ),
            (
                pb.GenerateRequest(body=b'{"prompt": "x"}', endpoint=pb.ENDPOINT_CHAT_COMPLETIONS),
                grpc.StatusCode.INVALID_ARGUMENT,
                "messages",
            ),
        ]
        for request, code, needle in cases:
            got, message = await rpc_error(_drain(stubs.router.Generate(request)))
            assert got == code and needle in message, (got, message)


async def _drain(call: Any) -> list[Any]:
    return [chunk async for chunk in call]


# --------------------------------------------------------------------------- health, admin


async def test_health_follows_draining_per_service(fleet: list[EmulatedEngine]) -> None:
    app = await start_router([e.url for e in fleet], grpc={"port": 0})
    try:
        async with connect(app.grpc_port) as stubs:
            for service in ("", "kvroute.v1.Router", "kvroute.v1.Admin"):
                assert await health_status(stubs.health, service) == "SERVING"
            code, _ = await rpc_error(
                stubs.health.Check(health_pb2.HealthCheckRequest(service="nope"))
            )
            assert code == grpc.StatusCode.NOT_FOUND
            app.begin_drain()
            for service in ("", "kvroute.v1.Router", "kvroute.v1.Admin"):

                async def not_serving(service: str = service) -> bool:
                    return await health_status(stubs.health, service) == "NOT_SERVING"

                await poll(not_serving)
            code, message = await rpc_error(stubs.router.Pick(pb.PickRequest(text="x")))
            assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in message
    finally:
        await app.stop()


async def test_reflection_lists_the_services(router: RouterApp) -> None:
    async with connect(router.grpc_port) as stubs:
        stub = reflection_pb2_grpc.ServerReflectionStub(stubs.channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        answers = [a async for a in stub.ServerReflectionInfo(iter([request]))]
    names = {s.name for s in answers[0].list_services_response.service}
    assert {"kvroute.v1.Router", "kvroute.v1.Admin", "grpc.health.v1.Health"} <= names


async def test_admin_adds_drains_and_removes_engines(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    extra = await start_test_engine(engine_id="grpc-extra")
    endpoint = f"127.0.0.1:{extra.port}"
    try:
        async with connect(router.grpc_port) as stubs:
            admin = stubs.admin
            listed = await admin.ListEngines(pb.ListEnginesRequest())
            assert len(listed.engines) == 3
            assert all(e.state == "healthy" and e.dp_size == 1 for e in listed.engines)
            added = await admin.AddEngine(pb.AddEngineRequest(url=extra.url, kv_events="none"))
            assert added.endpoint == endpoint and added.role == "both"
            await poll(lambda: router.registry.get(endpoint).discovered)
            drained = await admin.DrainEngine(pb.EngineRef(endpoint=endpoint))
            assert drained.state == "draining"
            for i in range(6):  # a drained engine gets no new requests
                pick = await stubs.router.Pick(pb.PickRequest(text=f"drained {i}"))
                assert pick.decode.endpoint != endpoint
                await stubs.router.Release(pb.ReleaseRequest(request_id=pick.request_id))
            undrained = await admin.UndrainEngine(pb.EngineRef(endpoint=extra.url))
            assert undrained.state == "healthy"
            removed = await admin.RemoveEngine(pb.EngineRef(endpoint=endpoint))
            assert removed.state == "removed"
            assert len((await admin.ListEngines(pb.ListEnginesRequest())).engines) == 3
            code, message = await rpc_error(admin.RemoveEngine(pb.EngineRef(endpoint=endpoint)))
            assert code == grpc.StatusCode.NOT_FOUND and endpoint in message
            code, message = await rpc_error(admin.AddEngine(pb.AddEngineRequest(url="nowhere")))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "url" in message
            code, message = await rpc_error(
                admin.AddEngine(pb.AddEngineRequest(url=extra.url, role="chef"))
            )
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "role" in message
    finally:
        await extra.stop()


async def test_admin_adds_an_engine_with_its_topology(router: RouterApp) -> None:
    extra = await start_test_engine(engine_id="grpc-topo")
    endpoint = f"127.0.0.1:{extra.port}"
    try:
        async with connect(router.grpc_port) as stubs:
            where = pb.EngineTopology(node="gpu-3", rack="r1")
            added = await stubs.admin.AddEngine(
                pb.AddEngineRequest(url=extra.url, kv_events="none", topology=where)
            )
            assert added.HasField("topology") and added.topology == where
            assert router.registry.get(endpoint).topology == Topology("gpu-3", "r1", None)
            listed = await stubs.admin.ListEngines(pb.ListEnginesRequest())
            others = [e for e in listed.engines if e.endpoint != endpoint]
            assert others and not any(e.HasField("topology") for e in others)
            await stubs.admin.RemoveEngine(pb.EngineRef(endpoint=endpoint))
    finally:
        await extra.stop()


@pytest.mark.parametrize("flag", ["grpc", "extproc"])
async def test_grpc_listeners_bind_where_configured(fleet: list[EmulatedEngine], flag: str) -> None:
    app = await start_router([fleet[0].url], **{flag: {"port": 0}})
    try:
        port = app.grpc_port if flag == "grpc" else app.extproc_port
        other = app.extproc_port if flag == "grpc" else app.grpc_port
        assert port and other is None
        async with connect(port) as stubs:
            assert await health_status(stubs.health, "") == "SERVING"
    finally:
        await app.stop()


@pytest.mark.parametrize(
    ("listener", "method"),
    [
        ("grpc", "/kvroute.v1.Router/Pick"),
        ("grpc", "/kvroute.v1.Router/Generate"),
        ("grpc", "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"),
        ("grpc", "/grpc.health.v1.Health/Watch"),
        ("extproc", "/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
    ],
)
async def test_a_request_that_is_no_message_is_invalid_argument_without_an_error_log(
    fleet: list[EmulatedEngine], listener: str, method: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Bytes that do not decode, on every kind of method (answers streamed or not,
    requests streamed or not): INVALID_ARGUMENT naming the method. grpc.aio answered
    UNKNOWN quoting the decoder's exception class, and logged an ERROR traceback for
    each (issue 44, item 9)."""
    app = await start_router([fleet[0].url], grpc={"port": 0}, extproc={"port": 0})
    caplog.set_level(logging.WARNING)
    garbage = b"\xff\xff\xff"
    try:
        port = app.grpc_port if listener == "grpc" else app.extproc_port
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            if method.endswith(("Info", "Process")):  # requests streamed
                call = channel.stream_stream(method)(iter([garbage]))
            else:
                call = channel.unary_stream(method)(garbage)  # any answer shape reads so
            code, message = await rpc_error(_drained(call))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, message)
        assert method in message and "not a valid protobuf message" in message
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    finally:
        await app.stop()


async def _drained(call: Any) -> list[Any]:
    return [answer async for answer in call]


async def test_concurrent_generate_calls_count_as_requests(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    async with connect(router.grpc_port) as stubs:
        outs = await asyncio.gather(
            *(generate(stubs.router, {"prompt": f"p {i}", "max_tokens": 2}) for i in range(5))
        )
    assert all(
        o.status == 200 and json.loads(o.data)["usage"]["completion_tokens"] == 2 for o in outs
    )
    samples = await metrics(http, router.url)
    assert metric_sum(samples, "kvroute_requests_total", route="completions", outcome="ok") == 5
    assert metric_sum(samples, "kvroute_grpc_requests_total", method="Generate", code="OK") == 5


async def test_kvroute_serve_flags_start_the_grpc_listeners(
    fleet: list[EmulatedEngine],
) -> None:
    """``--grpc-port 0 --extproc-port 0``: free ports, printed after the HTTP line."""
    args = ["--port", "0", "--grpc-port", "0", "--extproc-port", "0", "--engine", fleet[0].url]
    server = await asyncio.to_thread(ServerProcess, "serve", args)
    try:
        assert server.url.startswith("http://127.0.0.1:")
        lines = [await asyncio.to_thread(server.read_line, 30) for _ in range(2)]
        ports = {}
        for line in lines:
            match = re.fullmatch(
                r"kvroute serve (gRPC API|ext_proc) listening on 127\.0\.0\.1:(\d+)\n", line
            )
            assert match, line
            ports[match.group(1)] = int(match.group(2))
        async with connect(ports["gRPC API"]) as stubs:
            assert await health_status(stubs.health, "kvroute.v1.Router") == "SERVING"
            pick = await stubs.router.Pick(pb.PickRequest(text="from the command line"))
            assert pick.decode.endpoint == f"127.0.0.1:{fleet[0].port}"
        async with connect(ports["ext_proc"]) as stubs:
            assert await health_status(stubs.health, "readiness") == "SERVING"
    finally:
        await asyncio.to_thread(server.stop)


async def test_generate_shares_the_http_admission_queue() -> None:
    """One slot (limits.max_inflight 1): a Generate waits while an HTTP stream holds it
    and is served once it ends; with no queue it gets RESOURCE_EXHAUSTED at once."""
    slow = await start_test_engine(engine_id="grpc-slow", time_scale=1.0)
    app = await start_router(
        [slow.url], grpc={"port": 0}, limits={"max_inflight": 1, "admission_timeout_s": 30}
    )
    try:
        async with session() as http, connect(app.grpc_port) as stubs:
            body = {"prompt": "hold the slot " * 10, "max_tokens": 30, "stream": True}
            async with http.post(f"{app.url}/v1/completions", json=body) as holder:
                await holder.content.readany()
                waiting = asyncio.ensure_future(
                    generate(stubs.router, {"prompt": "queued", "max_tokens": 2})
                )
                await poll(lambda: app.admission.waiting == 1)
                assert not waiting.done()
                await holder.read()
            out = await waiting
            assert out.status == 200
            app.config.limits.admission_queue = 0
            async with http.post(f"{app.url}/v1/completions", json=body) as holder:
                await holder.content.readany()
                got, message = await rpc_error(
                    generate(stubs.router, {"prompt": "shed", "max_tokens": 2})
                )
                assert got == grpc.StatusCode.RESOURCE_EXHAUSTED and "in flight" in message
                await holder.read()
        assert app.admission.in_flight == 0
    finally:
        await app.stop()
        await slow.stop()
