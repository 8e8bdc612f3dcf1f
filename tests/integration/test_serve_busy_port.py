"""``kvroute serve`` and ``kvroute sidecar`` on a port that is taken: one line, no
traceback, and no engine contacted first (issue 19, item 13)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
from support.listener import CountingListener


@pytest.fixture
def busy() -> Iterator[int]:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock.getsockname()[1]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "router", *args], capture_output=True, text=True, timeout=60
    )


def test_serve_on_a_taken_port_fails_in_one_line_before_touching_engines(busy: int) -> None:
    engine = CountingListener()
    try:
        done = run(
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(busy),
            "--engine",
            f"http://127.0.0.1:{engine.port}",
        )
    finally:
        engine.close()
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [f"kvroute serve: cannot listen on 127.0.0.1:{busy}: Address already in use"]
    assert engine.accepted == 0


def test_sidecar_on_a_taken_port_fails_in_one_line(busy: int) -> None:
    done = run(
        "sidecar", "--host", "127.0.0.1", "--port", str(busy), "--engine", "http://127.0.0.1:1"
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"kvroute sidecar: cannot listen on 127.0.0.1:{busy}: Address already in use"
    )


@pytest.mark.parametrize(
    ("flag", "what"), [("--grpc-port", "gRPC API"), ("--extproc-port", "ext_proc")]
)
def test_serve_with_a_taken_grpc_port_fails_in_one_line_before_touching_engines(
    busy: int, flag: str, what: str
) -> None:
    engine = CountingListener()
    try:
        done = run(
            "serve",
            *("--host", "127.0.0.1", "--port", "0", flag, str(busy)),
            *("--engine", f"http://127.0.0.1:{engine.port}"),
        )
    finally:
        engine.close()
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"kvroute serve: {what}: cannot listen on 127.0.0.1:{busy}: Address already in use"
    ]
    assert engine.accepted == 0
