"""Start and stop an emulated engine inside the current asyncio event loop.

``kvroute engine`` uses this, and so do tests that want engines in their own process::

    engine = await start_engine(EmulatorConfig(port=0))
    ...  # engine.url, engine.kv_events_endpoint, ...
    await engine.stop()

or ``async with await start_engine(config) as engine: ...``. Several engines may run in
one process: each has its own registry, ZMQ context and uvicorn server.

With ``dp_size`` N the server runs N ranks behind its one HTTP port, each with its own
engine model, clock, KV-event publisher (vLLM's endpoint offsets) and NIXL side channel
(port + rank). A prefill-role engine also serves SGLang's bootstrap listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import socket
from collections.abc import Generator
from types import TracebackType
from typing import Any

import uvicorn
import zmq.asyncio

from router import __version__
from router.emulator.app import build_app, quiet_injected_drops
from router.emulator.config import EmulatorConfig
from router.emulator.driver import EngineDriver
from router.emulator.faults import Faults
from router.emulator.handoff import wire
from router.emulator.handoff.nixl import SideChannel
from router.emulator.handoff.sglang import BootstrapServer, RoomRegistry
from router.emulator.kv_publisher import PUB_HWM, KVEventPublisher, rank_endpoint
from router.emulator.metrics import EngineMetrics
from router.emulator.state import EmulatorState, Rank
from router.engine_model import EngineModel
from router.events.publishers import PublisherCurve

_START_TIMEOUT_S = 10.0


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its host program."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    """The HTTP listening socket; an OSError whose ``strerror`` names the address."""
    try:
        return _bind(host, port)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise OSError(exc.errno, f"cannot listen on {_url_host(host)}:{port}: {reason}") from None


def _bind(host: str, port: int) -> socket.socket:
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
        listeners: list[wire.Listener],
        zmq_ctx: zmq.asyncio.Context,
    ) -> None:
        self.config = config
        self.state = state
        self._server = server
        self._serving = serving
        self._publishers = publishers
        self._listeners = listeners
        self._zmq_ctx = zmq_ctx
        info = state.server_info
        self.host: str = config.host
        self.port: int = info["port"]
        self.url: str = info["url"]
        self.kv_events_endpoint: str | None = info["kv_events_endpoint"]
        self.kv_events_replay_endpoint: str | None = info["kv_events_replay_endpoint"]
        self.kv_events_topic: str | None = info["kv_events_topic"]
        self.side_channel_port: int = info["side_channel_port"]
        self.bootstrap_port: int | None = info["bootstrap_port"]

    @property
    def kv_batches_published(self) -> int:
        """The KV-event batches its ranks have published so far."""
        return sum(p.published for p in self._publishers)

    def startup_line(self) -> str:
        """The one line a kvroute server prints when it is ready."""
        cfg = self.config
        line = (
            f"kvroute engine {cfg.engine_id} (model {cfg.model}, role {cfg.role}, "
            f"block size {cfg.params.block_size}, dp size {cfg.dp_size}) listening on {self.url}"
        )
        if self.kv_events_endpoint:
            line += f" kv-events {self.kv_events_endpoint} topic {self.kv_events_topic or repr('')}"
            if self.kv_events_replay_endpoint:
                line += f" replay {self.kv_events_replay_endpoint}"
        line += f" side-channel {_url_host(cfg.kv_host)}:{self.side_channel_port}"
        if self.bootstrap_port is not None:
            line += f" bootstrap {_url_host(cfg.host)}:{self.bootstrap_port}"
        return line

    async def stop(self) -> None:
        """Stop serving, stop the engine loops and close every socket."""
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._serving
        for listener in self._listeners:
            await listener.stop()
        await self.state.stop_background()
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


def _rank_publishers(
    config: EmulatorConfig, ctx: zmq.asyncio.Context, topic: str, faults: Faults
) -> list[KVEventPublisher]:
    """One publisher per rank (vLLM's endpoint offsets), or none without an endpoint."""
    endpoint = config.kv_events_endpoint
    if not endpoint:
        return []
    replay = config.kv_events_replay_endpoint
    curve = None
    if config.kv_events_curve_key and config.kv_events_curve_server_key:
        curve = PublisherCurve.load(config.kv_events_curve_key, config.kv_events_curve_server_key)
    publishers: list[KVEventPublisher] = []
    try:
        for r in range(config.dp_size):
            publishers.append(
                KVEventPublisher(
                    ctx,
                    rank_endpoint(endpoint, r),
                    topic,
                    config.kv_events_format,
                    rank_endpoint(replay, r) if replay else None,
                    data_parallel_rank=r,
                    faults=faults,
                    replay_frames=config.kv_events_replay_frames,
                    buffer_steps=config.kv_events_buffer_steps,
                    curve=curve,
                )
            )
    except BaseException:
        for publisher in publishers:
            publisher.close()
        raise
    return publishers


def _kv_event_sources(publishers: list[KVEventPublisher]) -> dict[str, Any]:
    """``/kv_event_sources`` as vLLM 0.32 serves it: each rank's events configuration, its
    endpoints as bound (a wildcard host means the engine's own host)."""
    return {
        str(p.data_parallel_rank): {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": p.endpoint,
            "replay_endpoint": p.replay_endpoint,
            "buffer_steps": p.buffer_steps,
            "hwm": PUB_HWM,
            "max_queue_size": PUB_HWM,
            "topic": p.topic,
        }
        for p in publishers
    }


def _server_info(
    config: EmulatorConfig,
    url: str,
    port: int,
    topic: str,
    ranks: list[Rank],
    publishers: list[KVEventPublisher],
    bootstrap_port: int | None,
) -> dict[str, Any]:
    """``/server_info``: what was configured and bound. The single-rank fields describe
    rank 0; ``ranks`` lists every rank's own endpoints."""
    params = config.params
    pub = publishers[0] if publishers else None
    return {
        "engine_id": config.engine_id,
        "role": config.role,
        "model": config.model,
        "version": __version__,
        "url": url,
        "host": config.host,
        "port": port,
        "block_size": params.block_size,
        "num_gpu_blocks": params.num_gpu_blocks,
        "max_model_len": params.max_model_len,
        "max_num_batched_tokens": params.max_num_batched_tokens,
        "max_num_seqs": params.max_num_seqs,
        "dp_size": config.dp_size,
        "time_scale": config.time_scale,
        "kv_events_endpoint": pub.endpoint if pub else None,
        "kv_events_replay_endpoint": pub.replay_endpoint if pub else None,
        "kv_events_topic": topic if pub else None,
        "kv_events_format": config.kv_events_format if pub else None,
        "side_channel_host": config.kv_host,
        "side_channel_port": ranks[0].side_channel_port,
        "bootstrap_port": bootstrap_port,
        "ranks": [
            {
                "rank": rank.index,
                "kv_engine_id": rank.kv_engine_id,
                "side_channel_port": rank.side_channel_port,
                "kv_events_endpoint": publishers[rank.index].endpoint if publishers else None,
                "kv_events_replay_endpoint": (
                    publishers[rank.index].replay_endpoint if publishers else None
                ),
            }
            for rank in ranks
        ],
        "handoff": {
            "handoff_failure": config.handoff_failure,
            "kv_bytes_per_token": params.kv_bytes_per_token,
            "kv_transfer_bandwidth": params.kv_transfer_bandwidth,
            "kv_hold_timeout_s": params.kv_hold_timeout_s,
            "bootstrap_timeout_s": config.bootstrap_timeout_s,
        },
        "timing": {
            "step_overhead_s": params.step_overhead_s,
            "prefill_token_s": params.prefill_token_s,
            "decode_seq_s": params.decode_seq_s,
            "context_token_s": params.context_token_s,
        },
    }


async def _start_listeners(
    config: EmulatorConfig, state: EmulatorState, listeners: list[wire.Listener]
) -> int | None:
    """Bind each rank's side channel and, on a prefill engine, the bootstrap listener.

    Bound listeners are appended to ``listeners`` as they start (for cleanup); returns
    the bootstrap port.
    """
    for rank in state.ranks:
        channel = SideChannel(rank.kv_engine_id, rank.driver)
        port = config.side_channel_port + rank.index if config.side_channel_port else 0
        await channel.listener.start(config.kv_host, port)
        listeners.append(channel.listener)
        rank.side_channel_port = channel.listener.port
    if state.rooms is None:
        return None
    bootstrap = BootstrapServer(state.rooms)
    await bootstrap.listener.start(config.host, config.bootstrap_port)
    listeners.append(bootstrap.listener)
    return bootstrap.listener.port


async def start_engine(config: EmulatorConfig) -> EmulatedEngine:
    """Bind, start serving and return once ``config``'s engine accepts requests."""
    sock = _listen(config.host, config.port)
    port = sock.getsockname()[1]
    scheme = "https" if config.tls_cert_file else "http"
    url = f"{scheme}://{_url_host(config.host)}:{port}"
    zmq_ctx = zmq.asyncio.Context()
    publishers: list[KVEventPublisher] = []
    listeners: list[wire.Listener] = []
    faults = dataclasses.replace(config.faults)
    drivers: list[EngineDriver] = []
    try:
        # "" is vLLM's own default topic (and the only one vllm-router's static sources
        # accept), so only None picks llm-d's convention.
        topic = config.kv_events_topic
        if topic is None:
            topic = f"kv@{config.host}:{port}@{config.model}"
        publishers = _rank_publishers(config, zmq_ctx, topic, faults)
        hash_seed = config.hash_seed if config.hash_seed is not None else random.getrandbits(64)
        metrics = EngineMetrics(config.model, config.params, config.kv_events_format == "sglang")
        ranks: list[Rank] = []
        for r in range(config.dp_size):
            # Each rank is an engine of its own; their hashes differ like separate vLLM
            # engine cores' would (each draws its own seed).
            model = EngineModel(config.params, hash_seed + r)
            # SGLang's HiCache publishes a host-tier store with the page's tokens.
            model.cache.offload_tokens = config.kv_events_format == "sglang"
            rank_metrics = metrics.add_rank(str(r), model.stats)
            on_events = publishers[r].publish if publishers else None
            driver = EngineDriver(model, config.time_scale, on_events, rank_metrics.observe)
            drivers.append(driver)
            kv_engine_id = f"{config.engine_id}_dp{r}" if config.dp_size > 1 else config.engine_id
            ranks.append(Rank(r, driver, rank_metrics, kv_engine_id))
        rooms = None
        if config.role == "prefill":
            hold_wall = config.params.kv_hold_timeout_s * config.time_scale
            rooms = RoomRegistry(config.bootstrap_timeout_s, hold_wall)
        state = EmulatorState(
            config=config, ranks=ranks, metrics=metrics, server_info={}, faults=faults, rooms=rooms
        )
        bootstrap_port = await _start_listeners(config, state, listeners)
        state.server_info.update(
            _server_info(config, url, port, topic, ranks, publishers, bootstrap_port)
        )
        state.kv_event_sources.update(_kv_event_sources(publishers))
        quiet_injected_drops()
        uv_config = uvicorn.Config(
            build_app(state),
            http="httptools",
            ws="none",
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
            ssl_certfile=config.tls_cert_file,
            ssl_keyfile=config.tls_key_file,
        )
        server = _Server(uv_config)
    except BaseException:
        for listener in listeners:
            await listener.stop()
        for publisher in publishers:
            publisher.close()
        zmq_ctx.term()
        sock.close()
        raise
    for publisher in publishers:
        publisher.start()
    for driver in drivers:
        driver.start()
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    engine = EmulatedEngine(config, state, server, serving, publishers, listeners, zmq_ctx)
    deadline = asyncio.get_running_loop().time() + _START_TIMEOUT_S
    while not server.started:
        if serving.done() or asyncio.get_running_loop().time() > deadline:
            await engine.stop()
            raise RuntimeError(f"engine {config.engine_id} did not start on {url}")
        await asyncio.sleep(0.005)
    return engine
