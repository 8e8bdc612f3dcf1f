"""``kvroute engine`` as a separate process: start-up line, serving, clean exit."""

from __future__ import annotations

import socket
import subprocess
import sys

import aiohttp
import pytest
from support.clients import get, post
from support.engines import EngineProcess

from router.cli import main


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
        with pytest.raises(TimeoutError):  # a running server's next line is waited for
            proc.read_line(timeout=0.1)
        assert proc.terminate() == 0
        assert proc.read_line(timeout=10) == ""  # nothing more was printed
    finally:
        proc.stop()


def test_invalid_settings_exit_with_status_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "router", "engine", "--port", "0", "--time-scale", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "argument --time-scale: expected a number above 0, got '0'" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--cache-blocks", "-5", "a whole number >= 1"),
        ("--block-size", "0", "a whole number >= 1"),
        ("--max-model-len", "1", "a whole number >= 2"),
        ("--cpu-offload-blocks", "-1", "a whole number >= 0"),
        ("--kv-transfer-bandwidth", "0", "a number above 0"),
        ("--step-overhead-ms", "-1", "a number >= 0"),
        ("--dp-size", "0", "a whole number >= 1"),
        ("--port", "70000", "a whole number in [0, 65535]"),
        ("--bootstrap-timeout", "nan", "a number above 0"),
    ],
)
def test_a_bad_setting_is_refused_naming_its_flag(
    flag: str, value: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Not the engine model's field (--cache-blocks -5 said "num_gpu_blocks").
    with pytest.raises(SystemExit) as exited:
        main(["engine", "--port", "0", flag, value])
    assert exited.value.code == 2
    assert f"argument {flag}: expected {expected}, got '{value}'" in capsys.readouterr().err


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
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"kvroute engine: cannot listen on 127.0.0.1:{port}: Address already in use"
    )
    assert result.stdout == ""
