"""The router's KV-event subscriber against emulated engines (real ZMQ on loopback)."""

from __future__ import annotations

import socket
from pathlib import Path

import aiohttp
from support.clients import post
from support.engines import poll, start_test_engine
from support.routers import start_router

from router.hashing import block_keys, seed_for
from router.types import EngineKey

MODEL = "kvroute-emulated"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_an_engine_restart_clears_its_entries_and_rebuilds_from_new_events(
    ipc_dir: Path, http: aiohttp.ClientSession
) -> None:
    http_port, replay_port = free_port(), free_port()
    settings = {
        "engine_id": "phoenix",
        "port": http_port,
        "kv_events_endpoint": f"ipc://{ipc_dir}/phoenix",
        "kv_events_replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    }
    engine = await start_test_engine(**settings)
    # Short-lived decision records, so what the old engine's events said is all that lasts.
    app = await start_router([engine.url], policy={"provisional_ttl_s": 0.3})
    key = EngineKey(f"127.0.0.1:{http_port}")

    def depth(prompt: str) -> int:
        keys = block_keys(app.tokenizers.words.encode(prompt), 16, seed_for(MODEL))
        match = app.index.lookup_now(keys, [key]).get(key)  # type: ignore[attr-defined]
        return match.blocks if match else 0

    old = " ".join(f"old{i}" for i in range(320))
    new = " ".join(f"new{i}" for i in range(320))
    try:
        await poll(lambda: app.subscriber and app.subscriber.stats.replays["ok"] == 1)
        for i in range(3):  # a few batches, so the old sequence is well past 0
            assert (
                await post(
                    http, f"{app.url}/v1/completions", {"prompt": f"{old} {i}", "max_tokens": 1}
                )
            )[0] == 200
        await poll(lambda: app.ingestor.counters.blocks_stored >= 20)
        await poll(lambda: depth(old) == 20)
        await engine.stop()
        engine = await start_test_engine(**{**settings, "hash_seed": 99})
        await poll(lambda: app.registry.get(key.endpoint).state.value == "healthy", timeout=10)
        assert (await post(http, f"{app.url}/v1/completions", {"prompt": new, "max_tokens": 1}))[
            0
        ] == 200
        await poll(lambda: app.subscriber.stats.restarts == 1, timeout=10)
        await poll(lambda: depth(new) == 20)
        # The restarted engine's cache is empty, and so, once the router's own decision
        # records expire, is the index's picture of it.
        await poll(lambda: depth(old) == 0)
        assert depth(new) == 20
    finally:
        await app.stop()
        await engine.stop()
