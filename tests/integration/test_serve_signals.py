"""``kvroute serve`` as a real process: SIGTERM drains, SIGHUP reloads.

The router runs as a child process (``router.process.ServerProcess``) in front of
emulated engines in this process; signals go to its process group.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
import yaml
from support.clients import metric_sum, metrics, post_reply, session
from support.engines import poll, start_test_engine
from support.grpc_clients import connect, health_status

from router.emulator import EmulatedEngine
from router.process import ServerProcess

GRPC_SERVICES = ("", "kvroute.v1.Router", "kvroute.v1.Admin")


@pytest_asyncio.fixture(scope="module")
async def slow_engine() -> AsyncIterator[EmulatedEngine]:
    """An engine in real time: a 300-token stream lasts about two seconds."""
    engine = await start_test_engine(engine_id="slow", time_scale=1.0)
    yield engine
    await engine.stop()


async def serve(config: dict, tmp_path: Path) -> tuple[ServerProcess, Path]:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    # The constructor blocks until the router prints its address: keep this loop (and
    # so the in-process engines) running meanwhile.
    proc = await asyncio.to_thread(ServerProcess, "serve", ["--port", "0", "--config", str(path)])
    return proc, path


def config_for(engine: EmulatedEngine, **sections: object) -> dict:
    return {
        "engines": [{"url": engine.url}],
        "health": {"interval_s": 0.1, "timeout_s": 0.5},
        **sections,
    }


def stderr_of(proc: ServerProcess) -> str:
    proc.stderr.seek(0)
    return proc.stderr.read()


async def test_sigterm_lets_a_stream_finish_then_exits_0(
    slow_engine: EmulatedEngine, tmp_path: Path
) -> None:
    config = config_for(slow_engine, server={"drain_timeout_s": 30}, grpc={"port": 0})
    proc, _ = await serve(config, tmp_path)
    try:
        line = await asyncio.to_thread(proc.read_line, 30)  # the gRPC listener's
        match = re.search(r"gRPC API listening on \S+:(\d+)", line)
        assert match, line
        grpc_port = int(match.group(1))
        async with connect(grpc_port) as stubs:
            for service in GRPC_SERVICES:
                assert await health_status(stubs.health, service) == "SERVING"
        async with session() as http:
            body = {"prompt": "drain me " * 20, "max_tokens": 300, "stream": True}
            async with http.post(f"{proc.url}/v1/completions", json=body) as resp:
                assert resp.status == 200
                first = await resp.content.readany()
                assert first.startswith(b"data: ")
                os.killpg(proc.proc.pid, signal.SIGTERM)

                async def refused() -> bool:
                    try:
                        async with session() as other:
                            await other.get(f"{proc.url}/ready")
                    except aiohttp.ClientConnectionError:
                        return True
                    return False

                # New HTTP connections are refused while the stream goes on; the gRPC
                # listener stays up and its health says NOT_SERVING for every service.
                await poll(refused, timeout=5)
                async with connect(grpc_port) as stubs:
                    for service in GRPC_SERVICES:

                        async def not_serving(service: str = service) -> bool:
                            return await health_status(stubs.health, service) == "NOT_SERVING"

                        await poll(not_serving, timeout=5)
                assert proc.proc.poll() is None
                rest = first + await resp.read()
            events = [e for e in rest.decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            assert not any('"error"' in e for e in events)
            tokens = sum(
                len(json.loads(e[6:])["choices"][0]["text"].split())
                for e in events[:-1]
                if json.loads(e[6:])["choices"]
            )
            assert tokens == 300
        assert await asyncio.to_thread(proc.proc.wait, 10) == 0
        assert "draining" in stderr_of(proc)
    finally:
        proc.stop()


def prefill_cost(reason: str) -> float:
    match = re.search(r"prefill=([0-9.]+)", reason)
    assert match, reason
    return float(match.group(1))


async def test_sighup_changes_a_policy_weight_without_failing_requests(
    slow_engine: EmulatedEngine, tmp_path: Path
) -> None:
    config = config_for(slow_engine, policy={"name": "kv_cost", "prefill_weight": 2.0})
    proc, path = await serve(config, tmp_path)
    statuses: list[int] = []
    reasons: list[str] = []
    stop = asyncio.Event()
    try:
        async with session() as http:

            async def traffic(worker: int) -> None:
                i = 0
                while not stop.is_set() and i < 400:
                    # 64 fresh words: 4 uncached blocks on every request.
                    prompt = " ".join(f"w{worker}x{i}y{j}" for j in range(64))
                    reply = await post_reply(
                        http, f"{proc.url}/v1/completions", {"prompt": prompt, "max_tokens": 1}
                    )
                    statuses.append(reply.status)
                    if reply.status == 200:
                        reasons.append(reply.headers["x-kvroute-reason"])
                    i += 1

            workers = [asyncio.ensure_future(traffic(w)) for w in range(3)]
            try:
                await poll(lambda: len(reasons) >= 10, timeout=10)
                before = prefill_cost(reasons[-1])
                # An invalid file is refused and the running configuration kept.
                path.write_text(yaml.safe_dump({**config, "policy": {"name": "fastest"}}))
                os.killpg(proc.proc.pid, signal.SIGHUP)
                await poll(lambda: "reload failed" in stderr_of(proc), timeout=5)
                changed = {**config, "policy": {"name": "kv_cost", "prefill_weight": 4.0}}
                changed["index"] = {"redis": {"namespace": "other"}}  # needs a restart
                path.write_text(yaml.safe_dump(changed))
                os.killpg(proc.proc.pid, signal.SIGHUP)
                await poll(lambda: prefill_cost(reasons[-1]) == 2 * before, timeout=10)
                seen = len(reasons)
                await poll(lambda: len(reasons) >= seen + 10, timeout=10)
            finally:
                stop.set()
                await asyncio.gather(*workers)
            assert statuses and set(statuses) == {200}, sorted(set(statuses))
            samples = await metrics(http, proc.url)
            assert metric_sum(samples, "kvroute_config_reloads_total", outcome="ok") == 1
            assert metric_sum(samples, "kvroute_config_reloads_total", outcome="failed") == 1
        log = stderr_of(proc)
        assert "policy.prefill_weight: 2.0 -> 4.0" in log
        assert "applied only after a restart: index.redis.namespace" in log
    finally:
        proc.stop()


@pytest.mark.parametrize("fmt", ["json"])
async def test_json_logs_carry_the_request_id_engine_and_reason(
    slow_engine: EmulatedEngine, tmp_path: Path, fmt: str
) -> None:
    config = config_for(slow_engine, server={"log_format": fmt, "access_log": True})
    proc, _ = await serve(config, tmp_path)
    try:
        async with session() as http:
            reply = await post_reply(
                http,
                f"{proc.url}/v1/completions",
                {"prompt": "log me", "max_tokens": 1},
                headers={"x-request-id": "req-logged-1"},
            )
            assert reply.status == 200

        def access_line() -> dict | None:
            for line in stderr_of(proc).splitlines():
                entry = json.loads(line)  # every line is JSON
                if entry.get("request_id") == "req-logged-1":
                    return entry
            return None

        entry = await poll(access_line, timeout=5)
        assert entry["logger"] == "kvroute.access"
        assert entry["level"] == "info"
        assert entry["status"] == 200
        assert entry["engine"] == reply.headers["x-kvroute-engine"]
        assert entry["reason"] == reply.headers["x-kvroute-reason"]
        assert entry["duration_ms"] > 0
    finally:
        proc.stop()


def test_discovery_without_credentials_exits_2_saying_so(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "router.yaml"
    missing = tmp_path / "no-kubeconfig"
    path.write_text(
        yaml.safe_dump({"discovery": {"kubernetes": {"enabled": True, "kubeconfig": str(missing)}}})
    )
    done = subprocess.run(
        [sys.executable, "-m", "router", "serve", "--port", "0", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        env={k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"},
    )
    assert done.returncode == 2, done.stderr
    assert "discovery.kubernetes: no Kubernetes API credentials" in done.stderr
    assert "Traceback" not in done.stderr
