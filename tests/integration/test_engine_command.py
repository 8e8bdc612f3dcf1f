"""``kvroute engine`` as a separate process: start-up line, serving, clean exit."""

from __future__ import annotations

import socket
import subprocess
import sys

import aiohttp
from support.clients import get, post
from support.engines import EngineProcess


async def test_the_engine_command_serves_and_exits_cleanly_on_sigterm(
    http: aiohttp.ClientSession,
) -> None:
    proc = EngineProcess(
        [
            "--port", "0",
            "--model", "demo-model",
            "--cache-blocks", "128",
            "--time-scale", "0.01",
            "--kv-events-endpoint", "tcp://127.0.0.1:*",
        ]
    )  # fmt: skip
    try:
        assert "kv-events tcp://127.0.0.1:" in proc.line
        status, info = await get(http, f"{proc.url}/server_info")
        assert status == 200 and info["model"] == "demo-model"
        assert info["num_gpu_blocks"] == 128 and info["max_model_len"] == 2_048
        assert info["kv_events_endpoint"] in proc.line
        status, answer = await post(http, f"{proc.url}/v1/completions", {"prompt": "hi"})
        assert status == 200 and answer["model"] == "demo-model"
        assert proc.terminate() == 0
        assert proc.proc.stdout is not None and proc.proc.stdout.read() == ""
    finally:
        proc.stop()


def test_invalid_settings_exit_with_status_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "router", "engine", "--port", "0", "--time-scale", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and "time_scale must be positive" in result.stderr
    assert result.stdout == ""


def test_a_taken_port_exits_with_status_1_and_says_so() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "router", "engine", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert result.returncode == 1 and "kvroute engine:" in result.stderr
    assert result.stdout == ""
