"""The ``latency`` policy through the front ends, on emulated engines: the online latency
model learning from streamed answers, SLO headers and session affinity on HTTP and gRPC."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest
import pytest_asyncio
from support.clients import get, post_reply
from support.engines import poll, start_test_engine
from support.grpc_clients import connect
from support.routers import StartRouter

from router.config import Config
from router.emulator import EmulatedEngine
from router.engine_model import EngineParams
from router.grpc.gen.kvroute.v1 import router_pb2 as pb
from router.policy.latency import LatencyPolicy
from router.reload import Reloader
from router.types import EngineKey


@pytest_asyncio.fixture(scope="module")
async def pair(ipc_dir: Path) -> AsyncIterator[list[EmulatedEngine]]:
    engines = [
        await start_test_engine(
            engine_id=f"lat{i}",
            kv_events_endpoint=f"ipc://{ipc_dir}/lat{i}",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
        )
        for i in range(2)
    ]
    yield engines
    for engine in engines:
        await engine.stop()


#: The latency policy with a session bonus that outweighs what tells two idle engines
#: apart here: turns follow each other at once, so on a busy machine the previous turn
#: can still be counted on the pinned engine (by a scrape, or by a peer whose load
#: change has not arrived yet), more than the default 5 ms of cost. What these tests
#: check is where the pins go.
SESSIONS = {"name": "latency", "latency": {"session_bonus_ms": 500}}


def prompt(tag: str, words: int = 300) -> str:
    return " ".join(f"{tag}{i}" for i in range(words))


async def metric(http: aiohttp.ClientSession, url: str, name: str) -> float | None:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


async def stream(http: aiohttp.ClientSession, url: str, body: dict, headers: dict) -> str:
    """A streamed completion; returns the router's reason header."""
    async with http.post(
        f"{url}/v1/completions", json={**body, "stream": True}, headers=headers
    ) as resp:
        assert resp.status == 200
        await resp.read()
        return resp.headers["x-kvroute-reason"]


async def test_streamed_answers_teach_the_latency_model_and_status_shows_it(
    routers: StartRouter, pair: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    app = await routers([e.url for e in pair], policy={"name": "latency"})
    for i in range(6):
        reason = await stream(http, app.url, {"prompt": prompt(f"learn{i}"), "max_tokens": 4}, {})
        assert reason.startswith("latency:") and "ttft=" in reason and "harm=" in reason
    status, engines = await get(http, f"{app.url}/admin/engines")
    assert status == 200
    fits = [r["latency"] for e in engines["engines"] for r in e["ranks"] if r["latency"]]
    assert sum(f["ttft_observations"] for f in fits) == 6
    assert sum(f["tpot_observations"] for f in fits) == 6  # 4 tokens each: a pace to learn
    assert all(f["prefill_us_per_token"] > 0 for f in fits)
    # A streamed chat answer teaches both lines; a Responses stream, whose first events
    # come before the prefill, teaches neither.
    async with http.post(
        f"{app.url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": prompt("chat")}],
            "max_tokens": 4,
            "stream": True,
        },
    ) as resp:
        assert resp.status == 200
        await resp.read()
    async with http.post(
        f"{app.url}/v1/responses",
        json={"input": prompt("resp"), "max_output_tokens": 4, "stream": True},
    ) as resp:
        assert resp.status == 200
        await resp.read()
    status, engines = await get(http, f"{app.url}/admin/engines")
    fits = [r["latency"] for e in engines["engines"] for r in e["ranks"] if r["latency"]]
    assert sum(f["ttft_observations"] for f in fits) == 7
    assert sum(f["tpot_observations"] for f in fits) == 7
    assert await metric(http, app.url, "kvroute_engine_prefill_seconds_per_token") is not None


async def test_slo_headers_on_http(
    routers: StartRouter, pair: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    app = await routers([e.url for e in pair], policy={"name": "latency"})
    url = f"{app.url}/v1/completions"
    body = {"prompt": prompt("slo"), "max_tokens": 2}
    easy = await post_reply(http, url, body, {"x-slo-ttft-ms": "60000", "x-slo-tpot-ms": "5000"})
    assert easy.status == 200 and ":slo_unmet" not in easy.headers["x-kvroute-reason"]
    hard = await post_reply(http, url, body, {"x-slo-ttft-ms": "0.001"})
    assert hard.status == 200  # still served: by the least predicted violation
    assert hard.headers["x-kvroute-reason"].startswith("latency:slo_unmet")
    assert await metric(http, app.url, "kvroute_slo_requests_total") == 2
    assert await metric(http, app.url, "kvroute_slo_unmet_total") == 1
    for bad in ("fast", "-5", "0", "nan", "inf", "1e-310", "5e-324", "0.0001", "1e9"):
        reply = await post_reply(http, url, body, {"x-slo-tpot-ms": bad})
        assert reply.status == 400, bad
        assert reply.body["error"]["param"] == "x-slo-tpot-ms"
        assert "milliseconds" in reply.body["error"]["message"], bad


async def test_a_models_default_slo_applies_without_headers(
    routers: StartRouter, pair: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    app = await routers(
        [e.url for e in pair],
        policy={"name": "latency", "latency": {"slo": {"*": {"ttft_ms": 0.001}}}},
    )
    reply = await post_reply(
        http, f"{app.url}/v1/completions", {"prompt": prompt("dflt"), "max_tokens": 2}
    )
    assert reply.headers["x-kvroute-reason"].startswith("latency:slo_unmet")
    relaxed = await post_reply(
        http,
        f"{app.url}/v1/completions",
        {"prompt": prompt("dflt"), "max_tokens": 2},
        {"x-slo-ttft-ms": "60000"},  # the header overrides the default
    )
    assert not relaxed.headers["x-kvroute-reason"].startswith("latency:slo_unmet")


async def test_a_session_returns_to_its_engine_on_http(
    routers: StartRouter, pair: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    app = await routers(
        [e.url for e in pair], policy={**SESSIONS, "session_header": "x-conversation"}
    )
    url = f"{app.url}/v1/completions"
    seen = []
    for turn in range(4):  # unrelated prompts: only the session ties them together
        reply = await post_reply(
            http,
            url,
            {"prompt": prompt(f"turn{turn}x"), "max_tokens": 2},
            {"x-conversation": "c-1"},
        )
        assert reply.status == 200
        seen.append(reply.headers["x-kvroute-engine"])
    assert len(set(seen)) == 1, seen
    # Without the key, the first unrelated prompt goes to the engine offered less work
    # lately: the other one.
    reply = await post_reply(http, url, {"prompt": prompt("free0x"), "max_tokens": 2})
    assert reply.headers["x-kvroute-engine"] != seen[0]


async def test_slo_and_session_on_grpc_pick(
    routers: StartRouter, pair: list[EmulatedEngine]
) -> None:
    app = await routers([e.url for e in pair], policy=SESSIONS, grpc={"port": 0})
    async with connect(app.grpc_port) as stubs:
        body = json.dumps({"prompt": prompt("grpc"), "max_tokens": 2}).encode()
        pick = await stubs.router.Pick(
            pb.PickRequest(request_id="g1", body=body),
            metadata=(("x-slo-ttft-ms", "0.001"),),
        )
        assert pick.decode.decision.reason == "slo_unmet"
        await stubs.router.Release(pb.ReleaseRequest(request_id="g1"))
        pick = await stubs.router.Pick(
            pb.PickRequest(request_id="g2", body=body, headers={"x-slo-ttft-ms": "60000"})
        )
        assert pick.decode.decision.reason != "slo_unmet"
        await stubs.router.Release(pb.ReleaseRequest(request_id="g2"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stubs.router.Pick(
                pb.PickRequest(request_id="g3", body=body, headers={"x-slo-tpot-ms": "soon"})
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "x-slo-tpot-ms" in (err.value.details() or "")
        engines = []
        for turn in range(3):
            other = json.dumps({"prompt": prompt(f"gs{turn}x"), "max_tokens": 2}).encode()
            pick = await stubs.router.Pick(
                pb.PickRequest(request_id=f"s{turn}", body=other, session="conv-9")
            )
            engines.append(pick.decode.endpoint)
            await stubs.router.Release(pb.ReleaseRequest(request_id=f"s{turn}"))
        assert len(set(engines)) == 1, engines
        # The gateway served the next turn elsewhere (a fallback): the pin follows it.
        pick = await stubs.router.Pick(pb.PickRequest(request_id="s3", body=body, session="conv-9"))
        policy = app.core.policy
        assert isinstance(policy, LatencyPolicy)
        assert policy.sessions.get("conv-9", policy._clock()) == EngineKey(pick.decode.endpoint)
        elsewhere = next(
            e.url.split("//")[1] for e in pair if e.url.split("//")[1] != pick.decode.endpoint
        )
        await stubs.router.Release(pb.ReleaseRequest(request_id="s3", served_endpoint=elsewhere))
        assert policy.sessions.get("conv-9", policy._clock()) == EngineKey(elsewhere)
    await poll(lambda: app.core.loads.in_flight == 0)


@pytest.mark.parametrize("mode", ["redis", "replicated"])
async def test_a_session_finds_its_engine_through_another_replica(
    routers: StartRouter,
    pair: list[EmulatedEngine],
    http: aiohttp.ClientSession,
    redis_url: str,
    redis_namespace: str,
    mode: str,
) -> None:
    """Two replicas sharing Redis: a conversation's turns alternate replicas and every
    turn goes where the first went (the pins travel on the decision stream)."""
    index = {
        "backend": mode,
        "redis": {"url": redis_url, "namespace": redis_namespace, "budget_ms": 1000},
    }
    urls = [e.url for e in pair]
    a = await routers(urls, policy=SESSIONS, index=index)
    b = await routers(urls, policy=SESSIONS, index=index)
    for sessions in ("chat-1", "chat-2", "chat-3"):
        first = await post_reply(
            http,
            f"{a.url}/v1/completions",
            {"prompt": prompt(f"{sessions}-{mode}-first"), "max_tokens": 2},
            {"x-session-id": sessions},
        )
        engine = first.headers["x-kvroute-engine"]
        sync = b.replicated.sync if b.replicated is not None else b.session_sync
        assert sync is not None and sync.sessions is b.core.policy.sessions  # type: ignore[attr-defined]
        await poll(lambda s=sessions: b.core.policy.sessions.get(s, 1e-9) is not None)  # type: ignore[attr-defined]
        for turn in range(2):  # unrelated prompts: only the session ties them
            reply = await post_reply(
                http,
                f"{b.url}/v1/completions",
                {"prompt": prompt(f"{sessions}-{mode}-{turn}"), "max_tokens": 2},
                {"x-session-id": sessions},
            )
            assert reply.headers["x-kvroute-engine"] == engine, (sessions, turn)
    assert await metric(http, a.url, "kvroute_session_pins_published_total") == 3
    assert await metric(http, b.url, "kvroute_session_pins_learnt_total") == 3
    assert await metric(http, b.url, "kvroute_replica_sync_errors_total") == 0  # either mode


async def test_a_replica_started_later_learns_the_live_pins_at_start(
    routers: StartRouter,
    pair: list[EmulatedEngine],
    http: aiohttp.ClientSession,
    redis_url: str,
    redis_namespace: str,
) -> None:
    """Replicated mode: a new replica replays the stream's window, pins included."""
    index = {
        "backend": "replicated",
        "redis": {"url": redis_url, "namespace": redis_namespace, "budget_ms": 1000},
    }
    urls = [e.url for e in pair]
    a = await routers(urls, policy={"name": "latency"}, index=index)
    reply = await post_reply(
        http,
        f"{a.url}/v1/completions",
        {"prompt": prompt("late"), "max_tokens": 2},
        {"x-session-id": "early"},
    )
    engine = reply.headers["x-kvroute-engine"]
    assert a.replicated is not None
    await poll(lambda: a.replicated.sync.counters.sessions_published == 1)  # type: ignore[union-attr]
    b = await routers(urls, policy={"name": "latency"}, index=index)
    pinned = b.core.policy.sessions.get("early", 0.0)  # type: ignore[attr-defined]
    assert pinned is not None and pinned.label == engine


@pytest.mark.parametrize("load_push", [False, True])
async def test_a_reload_to_another_policy_stops_sharing_sessions(
    routers: StartRouter,
    pair: list[EmulatedEngine],
    redis_url: str,
    redis_namespace: str,
    load_push: bool,
) -> None:
    """The shared index's stream reader lives while the policy keeps sessions or load
    changes travel on the stream: without load changes a reload to kv_cost stops it,
    with them it stays and carries no pins; one back to latency shares them again."""
    index = {
        "backend": "redis",
        "redis": {
            "url": redis_url,
            "namespace": redis_namespace,
            "budget_ms": 1000,
            "load_push": load_push,
        },
    }
    app = await routers([e.url for e in pair], policy={"name": "latency"}, index=index)
    assert app.session_sync is not None and app.session_sync.sessions is not None
    assert (app.session_sync.load is app.shared_load) is load_push
    source = [app.config]
    reloader = Reloader(app.live, lambda: source[0], app.credentials)
    tree = app.config.model_dump()
    tree["policy"]["name"] = "kv_cost"
    source[0] = Config.model_validate(tree)
    stopped = app.session_sync
    await poll(lambda: stopped._tasks != [])  # it follows the stream
    assert await reloader.reload() is not None
    if load_push:
        assert app.session_sync is stopped and stopped.sessions is None
        assert stopped._tasks != []  # still following the stream, for the load
    else:
        assert app.session_sync is None
        assert stopped._tasks == []  # its stream reader is gone
        assert app.metrics.state.sources.session_sync is None
    tree["policy"]["name"] = "latency"
    source[0] = Config.model_validate(tree)
    assert await reloader.reload() is not None
    sync = app.session_sync
    assert sync is not None and sync.sessions is app.core.policy.sessions  # type: ignore[attr-defined]


# ------------------------------------------------------------- the default's terms, live


@pytest_asyncio.fixture
async def slow_pair(ipc_dir: Path) -> AsyncIterator[list[EmulatedEngine]]:
    """Two engines whose prefill takes a millisecond a token in real time, so that a burst
    sent at once is routed while its first request is still prefilling."""
    params = EngineParams(num_gpu_blocks=1_024, max_model_len=16_384, prefill_token_s=1e-3)
    engines = [
        await start_test_engine(
            engine_id=f"slow{i}",
            kv_events_endpoint=f"ipc://{ipc_dir}/slow{i}",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
            params=params,
            time_scale=1.0,
        )
        for i in range(2)
    ]
    yield engines
    for engine in engines:
        await engine.stop()


async def burst(http: aiohttp.ClientSession, url: str, prompts: list[str]) -> list[str]:
    """The engines that served ``prompts``, sent all at once."""
    replies = await asyncio.gather(
        *(
            post_reply(http, f"{url}/v1/completions", {"prompt": p, "max_tokens": 1})
            for p in prompts
        )
    )
    assert all(r.status == 200 for r in replies)
    return [r.headers["x-kvroute-engine"] for r in replies]


@pytest.mark.parametrize("idle_prefill_weight", [None, 2.0])
async def test_a_new_shared_prefix_is_copied_onto_the_idle_engine(
    routers: StartRouter,
    slow_pair: list[EmulatedEngine],
    http: aiohttp.ClientSession,
    idle_prefill_weight: float | None,
) -> None:
    """The busy term: on an engine nobody has sent work to lately, computing a prefix
    again costs only the request's own time, less than queueing behind the engine
    computing it and delaying the request there (its prompt shares that engine's steps).
    Priced at twice its time on the idle engine (as kv_cost prices every recompute), the
    second request queues behind the first."""
    app = await routers(
        [e.url for e in slow_pair],
        policy={"latency": {"idle_prefill_weight": idle_prefill_weight}},
    )
    shared = prompt("shared", 400)
    engines = await burst(http, app.url, [f"{shared} {prompt(f'q{n}x', 200)}" for n in range(2)])
    assert len(set(engines)) == (2 if idle_prefill_weight is None else 1), engines


async def test_samples_of_one_prompt_sent_at_once_stay_on_the_engine_computing_it(
    routers: StartRouter, slow_pair: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    """The tie rule: waiting for the engine computing the prompt costs about what computing
    it again on the idle one does (the prompt's last partial block aside), and a tie goes
    to the engine holding more of it."""
    app = await routers([e.url for e in slow_pair])  # the default
    engines = await burst(http, app.url, [prompt("sampled", 1009)] * 4)
    assert len(set(engines)) == 1, engines


@pytest.mark.parametrize("itl_weight", [1.0, 0.0])
async def test_a_long_prompt_goes_where_fewer_requests_are_in_flight(
    routers: StartRouter,
    slow_pair: list[EmulatedEngine],
    http: aiohttp.ClientSession,
    itl_weight: float,
) -> None:
    """The harm term: three streams decoding on the engine holding part of a long prompt
    make it cost the prompt's chunks' delay to each of them, more than the part it saves
    (without the term, the cache wins, and the decode term prices the slowdown the
    prompt's own decoding adds to the three)."""
    app = await routers([e.url for e in slow_pair], policy={"latency": {"itl_weight": itl_weight}})
    held_by, other = (e.url.removeprefix("http://") for e in slow_pair)
    shared = prompt("held", 1000)
    direct = {"prompt": shared, "max_tokens": 1}
    async with http.post(f"{slow_pair[0].url}/v1/completions", json=direct) as resp:
        assert resp.status == 200

    async def held() -> bool:
        entry = next(e for e in await app.admin.engines() if e["endpoint"] == held_by)
        return bool(entry["index_blocks"])

    await poll(held, timeout=10.0)
    opened = []
    try:
        for n in range(3):  # decoding for seconds (300 steps of 5 ms): closed below
            body = {"prompt": f"{shared} s{n}", "max_tokens": 300, "stream": True}
            response = await http.post(f"{app.url}/v1/completions", json=body)
            opened.append(response)
            assert response.headers["x-kvroute-engine"] == held_by, (
                response.headers["x-kvroute-reason"],
                app.tokenizers.modes(),
            )
        await poll(lambda: app.loads.view[EngineKey.parse(held_by)].decoding == 3, timeout=10.0)
        long_prompt = {"prompt": f"{shared} {prompt('long', 2000)}", "max_tokens": 50}
        reply = await post_reply(http, f"{app.url}/v1/completions", long_prompt)
        reason = reply.headers["x-kvroute-reason"]
        if itl_weight:
            assert reply.headers["x-kvroute-engine"] == other, (reason, held_by, other)
        else:
            assert reply.headers["x-kvroute-engine"] == held_by, reason
            decode = float(reason.split(" decode=")[1].split("ms")[0])
            assert decode > 0.0, reason  # 0.1 x 50 tokens x the TPOT slope x 3 sequences
    finally:
        for response in opened:
            response.close()
