"""Process-level faults: a ``kvroute engine`` child process SIGKILLed mid-stream in front
of a router in this process; and a router restarted while its engines keep their
caches, done in this process (one router app stopped, a fresh one with an empty index
started over the same in-process emulated engines), whose index comes back only
through KV-event replay over real ZMQ sockets."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import aiohttp
from support.clients import metric_sum, metrics, post_reply
from support.engines import EngineProcess, poll, start_test_engine
from support.routers import start_router

from router.fleet.registry import endpoint_of
from router.types import EngineKey


async def test_an_engine_killed_midstream_ends_the_stream_cleanly_and_is_ejected(
    http: aiohttp.ClientSession,
) -> None:
    """SIGKILL while a stream is relayed: the client gets an SSE error then [DONE] (no
    500, no hang), the load is released, the engine is ejected and the next request
    goes to the survivor."""
    doomed = EngineProcess(["--port", "0", "--time-scale", "1.0", "--engine-id", "doomed"])
    survivor = await start_test_engine(engine_id="survivor")
    app = await start_router(
        [doomed.url, survivor.url],
        policy={"name": "round_robin"},
        health={"eject_after_failures": 1},
    )
    try:
        doomed_key = EngineKey(endpoint_of(doomed.url))
        body = {"prompt": "a long answer please", "max_tokens": 500, "stream": True}
        text = ""
        for _ in range(2):  # round robin: one of the two goes to the doomed engine
            async with http.post(f"{app.url}/v1/completions", json=body) as resp:
                assert resp.status == 200
                if resp.headers["x-kvroute-engine"] != doomed_key.label:
                    await resp.read()
                    continue
                first = await resp.content.readany()
                assert first.startswith(b"data: ")
                os.killpg(doomed.proc.pid, signal.SIGKILL)
                text = (first + await resp.read()).decode()
                break
        events = [e for e in text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert '"error"' in events[-2] and "bad_gateway" in events[-2]
        assert app.core.loads.in_flight == 0
        engine = app.registry.get(doomed_key.endpoint)
        await poll(lambda: engine.state.value == "ejected")
        reply = await post_reply(
            http, f"{app.url}/v1/completions", {"prompt": "after", "max_tokens": 2}
        )
        assert reply.status == 200
        assert reply.headers["x-kvroute-engine"] == endpoint_of(survivor.url)
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_requests_total", outcome="stream_error") == 1
        assert metric_sum(samples, "kvroute_requests_total", status="500") == 0
    finally:
        await app.stop()
        await survivor.stop()
        doomed.stop()


async def test_a_restarted_router_rebuilds_its_index_from_replay(
    ipc_dir: Path, http: aiohttp.ClientSession
) -> None:
    """Router app 1 warms two engines' caches and stops; router app 2 (same process, a
    new app with an empty index) starts on the same engines, replays their KV events
    and routes a cached prefix back to the engine that holds it (the engines count the
    hit). Everything runs in this process; only the sockets are real."""
    engines = [
        await start_test_engine(
            engine_id=f"keep{i}",
            kv_events_endpoint=f"ipc://{ipc_dir}/keep{i}",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
        )
        for i in range(2)
    ]
    prompts = [" ".join(f"ctx{g}w{i}" for i in range(400)) for g in range(4)]
    try:
        first = await start_router([e.url for e in engines])
        try:
            placed = {}
            for g, prompt in enumerate(prompts):
                reply = await post_reply(
                    http, f"{first.url}/v1/completions", {"prompt": prompt, "max_tokens": 1}
                )
                assert reply.status == 200
                placed[g] = reply.headers["x-kvroute-engine"]
            assert len(set(placed.values())) == 2  # both engines hold something
        finally:
            await first.stop()
        second = await start_router([e.url for e in engines])
        try:
            await poll(lambda: second.subscriber and second.subscriber.stats.replays["ok"] == 2)
            await poll(lambda: second.ingestor.counters.blocks_stored >= 4 * 25)
            for g, prompt in enumerate(prompts):
                reply = await post_reply(
                    http,
                    f"{second.url}/v1/completions",
                    {"prompt": prompt + " again", "max_tokens": 1},
                )
                assert reply.headers["x-kvroute-engine"] == placed[g]
                assert "prefix_hit" in reply.headers["x-kvroute-reason"]
                cached = reply.body["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached >= 384
        finally:
            await second.stop()
    finally:
        for engine in engines:
            await engine.stop()
