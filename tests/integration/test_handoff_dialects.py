"""Handoff dialects are one module and one registry line: a toy dialect defined here,
registered at run time, serves splits end to end; the built-in ``sidecar`` dialect
hands the legs to ``kvroute sidecar`` beside the decode engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import aiohttp
import msgspec
import pytest
import pytest_asyncio
from support.clients import metric_sum, metrics
from support.engines import start_test_engine
from support.grpc_clients import connect
from support.routers import router_config, start_router

from router.config import ConfigError
from router.emulator import EmulatedEngine
from router.frontends.sidecar import start_sidecar
from router.grpc.gen.kvroute.v1 import router_pb2 as pb
from router.handoff import nixl, registry
from router.handoff.base import Handoff, Legs
from router.plan import Plan
from router.serving.context import RequestContext


# ----------------------------------------------------------------------- the toy dialect
class ToyHandoff(Handoff):
    """NIXL's pull, with the decode engine told the prefill engine in a header."""

    name = "toy"

    async def serve(self, ctx: RequestContext, plan: Plan, legs: Legs) -> None:
        assert plan.prefill is not None
        body = msgspec.json.encode(nixl.prefill_body(ctx.payload))
        status, answer = await legs.prefill_leg(ctx, plan.prefill, body)
        params = nixl.returned_params(answer)
        if status >= 400 or params is None:
            return await legs.local(ctx, plan.decode, "toy_no_params")
        await legs.decode_leg(
            ctx,
            plan.decode,
            msgspec.json.encode(nixl.decode_body(ctx.payload, params)),
            cached_tokens=ctx.request.prompt_tokens - 1,
            headers={"x-kvroute-mode": "split", "x-toy-prefill": plan.prefill.engine.label},
            upstream_headers={"x-toy-prefill": plan.prefill.engine.endpoint},
        )


# -----------------------------------------------------------------------------------------


def prompt(tag: str, words: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(words))


async def engine_metric(http: aiohttp.ClientSession, engine: EmulatedEngine, name: str) -> float:
    return metric_sum(await metrics(http, engine.url), name)


@pytest.fixture
def toy() -> Iterator[None]:
    registry.register("toy", ToyHandoff())  # the registry line
    yield
    registry.unregister("toy")


@pytest_asyncio.fixture(scope="module")
async def pair() -> AsyncIterator[dict[str, EmulatedEngine]]:
    prefill = await start_test_engine(engine_id="dialect-p", role="prefill")
    decode = await start_test_engine(engine_id="dialect-d", role="decode", handoff_failure="error")
    yield {"prefill": prefill, "decode": decode}
    await prefill.stop()
    await decode.stop()


def test_a_dialect_must_be_registered_to_be_configured() -> None:
    with pytest.raises(ConfigError, match="unknown handoff dialect 'toy'"):
        router_config([], disaggregation={"handoff": "toy"})
    with pytest.raises(ConfigError, match="unknown handoff dialect 'toy'"):
        router_config([], models=[{"name": "m", "handoff": "toy"}])


async def test_a_registered_dialect_serves_splits_over_http(
    toy: None, pair: dict[str, EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    prefill, decode = pair["prefill"], pair["decode"]
    app = await start_router(
        [{"url": prefill.url, "role": "prefill"}, {"url": decode.url, "role": "decode"}],
        disaggregation={"handoff": "toy"},
    )
    try:
        pulled = await engine_metric(http, decode, "kvroute_emulator_kv_pulled_tokens_total")
        body = {"prompt": prompt("toy", 1500), "max_tokens": 3}
        async with http.post(f"{app.url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["x-kvroute-mode"] == "split"
            assert resp.headers["x-toy-prefill"] == f"127.0.0.1:{prefill.port}"
            answer = await resp.json()
        assert answer["usage"]["completion_tokens"] == 3
        after = await engine_metric(http, decode, "kvroute_emulator_kv_pulled_tokens_total")
        assert after - pulled >= 1_400  # the toy's decode leg pulled the prefill's KV
    finally:
        await app.stop()


async def test_grpc_pick_names_the_registered_dialect(
    toy: None, pair: dict[str, EmulatedEngine]
) -> None:
    prefill, decode = pair["prefill"], pair["decode"]
    app = await start_router(
        [{"url": prefill.url, "role": "prefill"}, {"url": decode.url, "role": "decode"}],
        models=[{"name": "kvroute-emulated", "handoff": "toy"}],
        grpc={"port": 0},
    )
    try:
        async with connect(app.grpc_port) as stubs:
            pick = await stubs.router.Pick(pb.PickRequest(text=prompt("toypick", 1500)))
            assert pick.mode == pb.MODE_SPLIT
            assert pick.handoff.dialect == "toy"
            assert pick.headers["x-prefiller-host-port"] == f"127.0.0.1:{prefill.port}"
            await stubs.router.Release(pb.ReleaseRequest(request_id=pick.request_id))
    finally:
        await app.stop()


async def test_the_sidecar_dialect_hands_the_legs_to_the_decode_pods_sidecar(
    pair: dict[str, EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    prefill, decode = pair["prefill"], pair["decode"]
    runner, sidecar, sidecar_url = await start_sidecar(decode.url, ["127.0.0.1/32"])
    app = await start_router(
        [
            {"url": prefill.url, "role": "prefill"},
            {"url": sidecar_url, "role": "decode", "kv_events": "none"},
        ],
        disaggregation={"handoff": "sidecar"},
    )
    try:
        pulled = await engine_metric(http, decode, "kvroute_emulator_kv_pulled_tokens_total")
        prefilled = await engine_metric(http, prefill, "vllm:prompt_tokens_total")
        body = {"prompt": prompt("pod", 1200), "max_tokens": 3}
        async with http.post(f"{app.url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["x-kvroute-mode"] == "split"
            assert resp.headers["x-kvroute-prefill"] == f"127.0.0.1:{prefill.port}"
            await resp.read()
        assert await engine_metric(http, prefill, "vllm:prompt_tokens_total") - prefilled >= 1200
        after = await engine_metric(http, decode, "kvroute_emulator_kv_pulled_tokens_total")
        assert after - pulled >= 1_100  # the sidecar ran the NIXL legs
        assert app.core.loads.in_flight == 0  # the prefill engine's load was let go
    finally:
        await app.stop()
        await runner.cleanup()
        await sidecar.close()
