"""Reload and drain inside one process: what a reload applies, what a drain deadline does."""

from __future__ import annotations

import asyncio

import aiohttp
from support.clients import get, post_reply
from support.engines import poll, start_test_engine
from support.routers import router_config, start_router

from router.emulator import EmulatedEngine
from router.fleet.registry import endpoint_of
from router.reload import LIVE, Reloader, changed_keys, is_live


def test_every_live_key_names_a_configuration_key() -> None:
    from router.config import describe

    keys = [path for path, *_ in describe()]
    for prefix in LIVE:
        assert any(k == prefix or k.startswith(prefix) for k in keys), prefix
    assert is_live("policy.prefill_weight") and not is_live("index.backend")


async def test_reload_applies_policy_and_engines_and_keeps_restart_keys(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    other = await start_test_engine(engine_id="reload-other")
    app = await start_router([engine.url], policy={"name": "kv_cost"})
    try:
        new = router_config(
            [other.url],
            policy={"name": "round_robin"},
            index={"redis": {"namespace": "elsewhere"}},
            limits={"max_inflight": 7},
        )
        result = await Reloader(app.live, lambda: new, app.credentials).reload()
        assert result is not None
        assert set(result.applied) == {"engines", "policy.name", "limits.max_inflight"}
        assert set(result.restart) == {"index.redis.namespace"}
        assert app.config.index.redis.namespace == "kvroute"  # still what runs
        assert app.config.limits.max_inflight == 7
        assert app.core.policy.name == "round_robin"
        assert app.decider.decode_policy.name == "round_robin"
        assert app.registry.get(endpoint_of(engine.url)) is None
        await poll(
            lambda: (
                app.registry.candidates(app.registry.models()[0]) if app.registry.models() else None
            )
        )
        reply = await post_reply(
            http, f"{app.url}/v1/completions", {"prompt": "hi", "max_tokens": 1}
        )
        assert reply.status == 200
        assert reply.headers["x-kvroute-engine"] == endpoint_of(other.url)
        assert reply.headers["x-kvroute-reason"].startswith("round_robin:")
        # Nothing changed the second time.
        again = await Reloader(app.live, lambda: new, app.credentials).reload()
        assert again is not None and not again.applied
        assert set(again.restart) == {"index.redis.namespace"}
    finally:
        await app.stop()
        await other.stop()


def test_changed_keys_compare_lists_whole() -> None:
    a = router_config(["http://127.0.0.1:1"])
    b = router_config(["http://127.0.0.1:1", "http://127.0.0.1:2"], policy={"queue_weight": 3})
    assert set(changed_keys(a, b)) == {"engines", "policy.queue_weight"}


async def test_a_draining_router_answers_not_ready_and_stays_alive(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    app = await start_router([engine.url])
    try:
        await poll(lambda: app.registry.healthy_count() > 0)
        assert (await get(http, f"{app.url}/ready"))[0] == 200
        # SIGTERM's first step. In a process the HTTP listener closes right after it
        # (test_serve_signals.py): probes then see refused connections, and the gRPC
        # health service, which stays up, NOT_SERVING.
        app.begin_drain()
        status, body = await get(http, f"{app.url}/ready")
        assert status == 503 and body["reason"] == "draining"
        assert (await get(http, f"{app.url}/health"))[0] == 200
    finally:
        await app.stop()


async def test_a_drain_deadline_cancels_what_is_still_running(
    http: aiohttp.ClientSession,
) -> None:
    slow = await start_test_engine(engine_id="drain-slow", time_scale=1.0)
    app = await start_router([slow.url])
    try:
        await poll(lambda: app.registry.models())
        body = {"prompt": "long " * 10, "max_tokens": 2000, "stream": True}
        async with http.post(f"{app.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readany()
            assert app.observer.inflight == 1
            cancelled = await app.drain(0.2)
            assert cancelled == 1
            assert app.observer.inflight == 0
            try:
                rest = await resp.content.read()
            except aiohttp.ClientPayloadError:  # the connection closed mid-stream
                rest = b""
            assert b"[DONE]" not in rest  # cut short, not completed
        assert app.draining
        reply = await asyncio.wait_for(app.observer.wait_idle(0), 1)
        assert reply == 0
    finally:
        await app.stop()
        await slow.stop()


async def test_a_changed_config_file_triggers_a_reload(tmp_path) -> None:
    from types import SimpleNamespace

    from router.serve import _watch_file

    path = tmp_path / "router.yaml"
    path.write_text("policy: {prefill_weight: 2}\n")
    app = SimpleNamespace(config=router_config([], server={"reload_poll_s": 0.02}))
    calls: list[int] = []
    watcher = asyncio.ensure_future(_watch_file(str(path), app, lambda: calls.append(1)))
    try:
        await asyncio.sleep(0.1)
        assert calls == []  # unchanged content: nothing to do
        path.write_text("policy: {prefill_weight: 3}\n")
        await poll(lambda: calls == [1])
        path.unlink()  # a ConfigMap swap in progress: not a change
        await asyncio.sleep(0.1)
        path.write_text("policy: {prefill_weight: 3}\n")
        await asyncio.sleep(0.1)
        assert calls == [1]
    finally:
        watcher.cancel()
