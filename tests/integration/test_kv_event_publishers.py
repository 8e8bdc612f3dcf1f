"""Who may publish on the router's bound KV-event socket (issue 44, item 2).

A router binds its socket over TCP on loopback with CURVE keys; emulated engines
connect to it as publishers (``--kv-events-curve-key``): the engine the router routes
to, with an admitted key; a stranger with a key the router does not admit; and an
impostor on 127.0.0.2 with the admitted key, posting under the first engine's topic.
Only the first engine's events reach the index. Real ZMQ on loopback throughout.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq.auth
from support.clients import metric_sum, metrics, post
from support.engines import poll, start_test_engine
from support.routers import start_router

from router.app import RouterApp
from router.emulator import EmulatedEngine
from router.hashing import block_keys, seed_for
from router.types import EngineKey

MODEL = "kvroute-emulated"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """CURVE certificates: the router's, an admitted engine's (the only key in the
    admitted directory) and a stranger's."""
    admitted = tmp_path / "admitted"
    admitted.mkdir()
    files: dict[str, Path] = {"admitted": admitted}
    for name, where in (("router", tmp_path), ("engine", admitted), ("stranger", tmp_path)):
        public, secret = zmq.auth.create_certificates(where, name)
        files[name], files[f"{name}_secret"] = Path(public), Path(secret)
    return files


def indexed(app: RouterApp, prompt: str, engine: EngineKey) -> int:
    """Blocks of ``prompt`` the router's index holds for ``engine``."""
    keys = block_keys(app.tokenizers.words.encode(prompt), 16, seed_for(MODEL))
    match = app.index.lookup_now(keys, [engine]).get(engine)  # type: ignore[attr-defined]
    return match.blocks if match else 0


async def publishing(port: int, key: str, server_key: Path, **changes: Any) -> EmulatedEngine:
    """An engine that publishes its KV events to the router's socket with a CURVE key."""
    return await start_test_engine(
        kv_events_endpoint=f"tcp://127.0.0.1:{port}",
        kv_events_curve_key=key,
        kv_events_curve_server_key=str(server_key),
        **changes,
    )


async def test_only_an_admitted_engine_at_its_own_address_feeds_the_index(
    keys: dict[str, Path], http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    server_key = keys["router"]
    engine = await publishing(port, str(keys["engine_secret"]), server_key, engine_id="genuine")
    victim = f"kv@127.0.0.1:{engine.port}@{MODEL}"  # the genuine engine's topic
    stranger = await publishing(
        port, str(keys["stranger_secret"]), server_key, engine_id="stranger", kv_events_topic=victim
    )
    impostor = await start_test_engine(
        engine_id="impostor",
        host="127.0.0.2",
        kv_events_endpoint=f"tcp://127.0.0.2:0;127.0.0.1:{port}",  # from 127.0.0.2
        kv_events_curve_key=str(keys["engine_secret"]),
        kv_events_curve_server_key=str(server_key),
        kv_events_topic=victim,
    )
    caplog.set_level(logging.WARNING, logger="kvroute")
    app = await start_router(
        # kv_events none: the engine reports the router's own socket as its endpoint,
        # which is not one to connect to; its events arrive on the bound socket.
        [{"url": engine.url, "kv_events": "none"}],
        events={
            "bind_endpoint": f"tcp://127.0.0.1:{port}",
            "curve_secret_key_file": str(keys["router_secret"]),
            "curve_public_keys_dir": str(keys["admitted"]),
        },
    )
    key = EngineKey(f"127.0.0.1:{engine.port}")
    sent: dict[str, list[str]] = {"genuine": [], "stranger": [], "impostor": []}

    async def complete(name: str, on: EmulatedEngine) -> str:
        """A new prompt each time: an engine's first events may go out before its
        connection is up, and a prompt it holds already publishes nothing new."""
        prompt = " ".join(f"{name}{len(sent[name])}-{i}" for i in range(64))
        sent[name].append(prompt)
        status, _ = await post(http, f"{on.url}/v1/completions", {"prompt": prompt})
        assert status == 200
        return prompt

    try:
        assert app.subscriber is not None
        stats = app.subscriber.stats

        async def genuine_landed() -> bool:
            prompt = await complete("genuine", engine)
            await asyncio.sleep(0.05)
            return indexed(app, prompt, key) == 4

        await poll(genuine_landed, timeout=10)

        async def impostor_dropped() -> bool:
            await complete("impostor", impostor)
            await asyncio.sleep(0.05)
            return stats.address_mismatches > 0

        await poll(impostor_dropped, timeout=10)
        await poll(lambda: stats.publishers_refused > 0, timeout=10)
        await complete("stranger", stranger)
        dropped = stats.address_mismatches
        await complete("impostor", impostor)  # now connected: its events arrive, dropped
        await poll(lambda: stats.address_mismatches > dropped)
        last = await complete("genuine", engine)
        await poll(lambda: indexed(app, last, key) == 4)
        held = {name: [indexed(app, p, key) for p in prompts] for name, prompts in sent.items()}
        assert held["stranger"] == [0] * len(sent["stranger"])
        assert held["impostor"] == [0] * len(sent["impostor"])
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_kv_events_address_mismatch_total") >= 2
        assert metric_sum(samples, "kvroute_kv_event_publishers_refused_total") >= 1
        warnings = [r.getMessage() for r in caplog.records if r.name == "kvroute.events"]
        assert any("came from 127.0.0.2, not from engine" in w for w in warnings), warnings
        assert any("is not in events.curve_public_keys_dir" in w for w in warnings), warnings
    finally:
        await app.stop()
        for one in (engine, stranger, impostor):
            await one.stop()


async def test_a_bound_socket_open_beyond_loopback_without_keys_is_warned_about(
    engine: EmulatedEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvroute")
    app = await start_router([engine.url], events={"bind_endpoint": "tcp://0.0.0.0:*"})
    try:
        warning = [r for r in caplog.records if "without CURVE keys" in r.getMessage()]
        assert len(warning) == 1 and warning[0].levelno == logging.WARNING
        assert "events.curve_secret_key_file" in warning[0].getMessage()
    finally:
        await app.stop()
    caplog.clear()
    app = await start_router([engine.url], events={"bind_endpoint": "tcp://127.0.0.1:*"})
    try:
        assert not [r for r in caplog.records if "without CURVE keys" in r.getMessage()]
    finally:
        await app.stop()


def test_a_secret_key_file_that_holds_no_secret_stops_the_router(
    keys: dict[str, Path], tmp_path: Path
) -> None:
    import subprocess
    import sys

    config = tmp_path / "router.yaml"
    config.write_text(
        "engines: [{url: 'http://127.0.0.1:9'}]\n"
        "events:\n"
        "  bind_endpoint: tcp://127.0.0.1:*\n"
        f"  curve_secret_key_file: {keys['router']}\n"  # the public half
        f"  curve_public_keys_dir: {keys['admitted']}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "router", "serve", "--port", "0", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "events.curve_secret_key_file" in done.stderr and "holds no secret-key" in done.stderr
