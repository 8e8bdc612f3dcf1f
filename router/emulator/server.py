"""Start and stop an emulated engine inside the current asyncio event loop.

``kvroute engine`` uses this, and so do tests that want engines in their own process::

    engine = await start_engine(EmulatorConfig(port=0))
    ...  # engine.url, engine.kv_events_endpoint, ...
    await engine.stop()

or ``async with await start_engine(config) as engine: ...``. Several engines may run in
one process: each has its own registry, ZMQ context and uvicorn server.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from collections.abc import Generator
from types import TracebackType
from typing import Any

import uvicorn
import zmq.asyncio

from router import __version__
from router.emulator.app import EmulatorState, build_app
from router.emulator.config import EmulatorConfig
from router.emulator.driver import EngineDriver
from router.emulator.kv_publisher import KVEventPublisher
from router.emulator.metrics import EngineMetrics
from router.engine_model import EngineModel

_START_TIMEOUT_S = 10.0


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its host program."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this. Without it, a response written in two parts
    # (headers, then body) waits for the client's delayed ACK: 40 ms per request on a
    # reused keep-alive connection (asyncio's default loop does not set it for us).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class EmulatedEngine:
    """A running emulated engine: its addresses, its state, and ``stop()``."""

    def __init__(
        self,
        config: EmulatorConfig,
        state: EmulatorState,
        server: _Server,
        serving: asyncio.Task[None],
        publishers: list[KVEventPublisher],
        zmq_ctx: zmq.asyncio.Context,
    ) -> None:
        self.config = config
        self.state = state
        self._server = server
        self._serving = serving
        self._publishers = publishers
        self._zmq_ctx = zmq_ctx
        info = state.server_info
        self.host: str = config.host
        self.port: int = info["port"]
        self.url: str = info["url"]
        self.kv_events_endpoint: str | None = info["kv_events_endpoint"]
        self.kv_events_replay_endpoint: str | None = info["kv_events_replay_endpoint"]
        self.kv_events_topic: str | None = info["kv_events_topic"]

    def startup_line(self) -> str:
        """The one line a kvroute server prints when it is ready."""
        cfg = self.config
        line = (
            f"kvroute engine {cfg.engine_id} (model {cfg.model}, role {cfg.role}, "
            f"block size {cfg.params.block_size}) listening on {self.url}"
        )
        if self.kv_events_endpoint:
            line += f" kv-events {self.kv_events_endpoint} topic {self.kv_events_topic}"
            if self.kv_events_replay_endpoint:
                line += f" replay {self.kv_events_replay_endpoint}"
        return line

    async def stop(self) -> None:
        """Stop serving, stop the engine loop and close every socket."""
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._serving
        for driver in self.state.drivers:
            await driver.stop()
        for publisher in self._publishers:
            await publisher.aclose()
        self._zmq_ctx.term()

    async def __aenter__(self) -> EmulatedEngine:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


async def start_engine(config: EmulatorConfig) -> EmulatedEngine:
    """Bind, start serving and return once ``config``'s engine accepts requests."""
    sock = _listen(config.host, config.port)
    port = sock.getsockname()[1]
    url = f"http://{_url_host(config.host)}:{port}"
    zmq_ctx = zmq.asyncio.Context()
    publishers: list[KVEventPublisher] = []
    try:
        topic = config.kv_events_topic or f"kv@{config.host}:{port}@{config.model}"
        if config.kv_events_endpoint:
            publishers.append(
                KVEventPublisher(
                    zmq_ctx,
                    config.kv_events_endpoint,
                    topic,
                    config.kv_events_format,
                    config.kv_events_replay_endpoint,
                )
            )
        hash_seed = config.hash_seed if config.hash_seed is not None else random.getrandbits(64)
        metrics = EngineMetrics(config.model, config.params)
        model = EngineModel(config.params, hash_seed)
        pub = publishers[0] if publishers else None
        observe = metrics.add_rank("0", model.stats)
        driver = EngineDriver(model, config.time_scale, pub.publish if pub else None, observe)
        info: dict[str, Any] = {
            "engine_id": config.engine_id,
            "role": config.role,
            "model": config.model,
            "version": __version__,
            "url": url,
            "host": config.host,
            "port": port,
            "block_size": config.params.block_size,
            "num_gpu_blocks": config.params.num_gpu_blocks,
            "max_model_len": config.params.max_model_len,
            "max_num_batched_tokens": config.params.max_num_batched_tokens,
            "max_num_seqs": config.params.max_num_seqs,
            "dp_size": 1,
            "time_scale": config.time_scale,
            "kv_events_endpoint": pub.endpoint if pub else None,
            "kv_events_replay_endpoint": pub.replay_endpoint if pub else None,
            "kv_events_topic": topic if pub else None,
            "kv_events_format": config.kv_events_format if pub else None,
            "timing": {
                "step_overhead_s": config.params.step_overhead_s,
                "prefill_token_s": config.params.prefill_token_s,
                "decode_seq_s": config.params.decode_seq_s,
                "context_token_s": config.params.context_token_s,
            },
        }
        state = EmulatorState(config=config, drivers=[driver], metrics=metrics, server_info=info)
        uv_config = uvicorn.Config(
            build_app(state),
            http="httptools",
            ws="none",
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
        )
        server = _Server(uv_config)
    except BaseException:
        for publisher in publishers:
            publisher.close()
        zmq_ctx.term()
        sock.close()
        raise
    for publisher in publishers:
        publisher.start()
    driver.start()
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    engine = EmulatedEngine(config, state, server, serving, publishers, zmq_ctx)
    deadline = asyncio.get_running_loop().time() + _START_TIMEOUT_S
    while not server.started:
        if serving.done() or asyncio.get_running_loop().time() > deadline:
            await engine.stop()
            raise RuntimeError(f"engine {config.engine_id} did not start on {url}")
        await asyncio.sleep(0.005)
    return engine
