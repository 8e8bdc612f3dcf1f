"""The router's KV-event subscriber against emulated engines (real ZMQ on loopback)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import aiohttp
import zmq.asyncio
from support.clients import metric_sum, metrics, post
from support.engines import poll, start_test_engine
from support.routers import start_router
from support.vllm_publisher import Publisher

from router.events.types import BlockStored
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


async def test_a_rogue_publishers_block_size_drops_its_events_never_the_engine(
    ipc_dir: Path, http: aiohttp.ClientSession
) -> None:
    """Bind mode: anyone who reaches the bound socket may name an engine in the topic.
    A BlockStored with block size 32 for an engine whose /metrics say 16 is counted and
    dropped; the engine keeps serving, and well-formed events for it still land."""
    engine = await start_test_engine(engine_id="claimed")
    app = await start_router(
        [engine.url], events={"bind_endpoint": f"ipc://{ipc_dir}/central-rogue"}
    )
    ctx = zmq.asyncio.Context()
    pub = Publisher(ctx, app.subscriber.bound_endpoint, f"ipc://{ipc_dir}/rogue-replay", True)
    pub.topic = f"kv@127.0.0.1:{engine.port}@{MODEL}".encode()
    key = EngineKey(f"127.0.0.1:{engine.port}")
    try:
        await poll(lambda: app.registry.get(key.endpoint).block_size == 16)
        rogue = BlockStored([1], None, list(range(32)), 32, medium="GPU")

        async def counted() -> bool:
            pub.restart()  # resend from scratch until the connection is up
            await pub.publish([rogue])
            await asyncio.sleep(0.02)
            return app.ingestor.counters.skipped["block_size_mismatch"] > 0

        await poll(counted)
        for _ in range(3):
            await pub.publish([rogue])
        good = BlockStored([2], None, list(range(100, 116)), 16, medium="GPU")
        await pub.publish([good])
        await asyncio.sleep(0.1)
        assert app.registry.get(key.endpoint).state.value == "healthy"
        await poll(lambda: app.ingestor.counters.blocks_stored == 1)
        status, _ = await post(
            http, f"{app.url}/v1/completions", {"prompt": "still served", "max_tokens": 1}
        )
        assert status == 200
        samples = await metrics(http, app.url)
        mismatched = metric_sum(
            samples, "kvroute_kv_events_block_size_mismatch_total", engine=key.label
        )
        assert mismatched == app.ingestor.counters.block_size_mismatches[key] >= 4
        assert metric_sum(samples, "kvroute_engine_refused", engine=key.label) == 0
    finally:
        await pub.close()
        ctx.destroy(linger=0)
        await app.stop()
        await engine.stop()
