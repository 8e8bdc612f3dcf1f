"""How ``kvroute serve --engine URL`` finds an engine's KV events with no further
configuration: vLLM 0.32's ``GET /kv_event_sources``, else the ``events.port`` convention.

The engine here is a small HTTP server on loopback standing in for vLLM's API (it serves
``/v1/models``, ``/metrics`` and, when asked to, ``/kv_event_sources``, and no
``/server_info``, as vLLM without dev mode), beside a vLLM-style ZMQ publisher. Real vLLM
does the same in tests/realvllm.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio
import zmq.asyncio
from aiohttp import web
from support.engines import poll
from support.routers import start_router
from support.vllm_publisher import Publisher

from router.events.types import BlockStored
from router.types import EngineKey

MODEL = "plain-vllm"
METRICS = (
    'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n'
    'vllm:num_requests_running{engine="0",model_name="plain-vllm"} 0.0\n'
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PlainVllm:
    """The HTTP surface of a vLLM without dev mode, and its publisher."""

    def __init__(self, sources: dict[str, object] | None) -> None:
        self.sources = sources
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        models = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
        sources = self.sources

        async def get_models(_: web.Request) -> web.Response:
            return web.json_response(models)

        async def get_health(_: web.Request) -> web.Response:
            return web.Response()

        async def get_metrics(_: web.Request) -> web.Response:
            return web.Response(text=METRICS)

        async def get_sources(_: web.Request) -> web.Response:
            return web.json_response(sources)

        app.router.add_get("/v1/models", get_models)
        app.router.add_get("/health", get_health)
        app.router.add_get("/metrics", get_metrics)
        if sources is not None:
            app.router.add_get("/kv_event_sources", get_sources)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest_asyncio.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def follows(app, engine: PlainVllm, pub: Publisher) -> None:
    """The router subscribed: a published block reaches its index."""
    key = EngineKey(engine.url.removeprefix("http://"))
    stored = BlockStored([7], None, list(range(16)), 16, medium="GPU")

    async def landed() -> bool:
        await pub.publish([stored])
        held = await app.index.held_blocks()
        return held.get(key, 0) >= 1

    await poll(landed, timeout=10, interval=0.1)


async def test_kv_event_sources_alone_is_enough_to_subscribe(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    port = free_port()
    pub = Publisher(ctx, f"tcp://127.0.0.1:{port}", f"ipc://{tmp_path}/replay")
    # vLLM reports its bind address: a wildcard host means the engine's own host.
    sources = {
        "0": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            "replay_endpoint": pub.replay_endpoint,
            "topic": "",
        }
    }
    engine = PlainVllm(sources)
    await engine.start()
    app = await start_router([engine.url])
    try:
        (registered,) = list(app.registry)
        assert registered.events is not None
        assert registered.events.endpoint == f"tcp://127.0.0.1:{port}"
        assert registered.block_size == 16
        await follows(app, engine, pub)
    finally:
        await app.stop()
        await engine.stop()
        await pub.close()


async def test_the_port_convention_subscribes_to_engines_that_report_nothing(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    port, replay = free_port(), free_port()
    pub = Publisher(ctx, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
    engine = PlainVllm(None)  # an older vLLM: no /kv_event_sources
    await engine.start()
    app = await start_router([engine.url], events={"port": port, "replay_port": replay})
    try:
        (registered,) = list(app.registry)
        assert registered.events is not None
        assert registered.events.endpoint == f"tcp://127.0.0.1:{port}"
        assert registered.events.replay_endpoint == f"tcp://127.0.0.1:{replay}"
        await follows(app, engine, pub)
    finally:
        await app.stop()
        await engine.stop()
        await pub.close()


def test_kvroute_serve_has_a_flag_for_the_convention() -> None:
    import argparse

    from router.serve import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--engine", "http://127.0.0.1:9", "--kv-events-port", "5557"])
    config = config_from_args(args)
    assert config.events.port == 5557
    assert json.loads(config.model_dump_json())["events"]["port"] == 5557
