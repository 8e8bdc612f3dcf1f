"""Kubernetes service links beside the router (issue 44, item 13): a Service named
``kvroute`` gives every pod of its namespace ``KVROUTE_SERVICE_HOST``, ``KVROUTE_PORT``,
``KVROUTE_PORT_8000_TCP``... (the kubelet's shapes, pkg/kubelet/envvars). They carry the
configuration prefix but are no configuration: ``kvroute serve`` and ``kvroute config
check`` start with them set."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from router.emulator import EmulatedEngine
from router.process import ServerProcess

#: What the kubelet writes for the chart's Services: kvroute (port http 8000) and
#: kvroute-redis (port redis 6379).
SERVICE_LINKS = {
    "KVROUTE_SERVICE_HOST": "10.96.12.34",
    "KVROUTE_SERVICE_PORT": "8000",
    "KVROUTE_SERVICE_PORT_HTTP": "8000",
    "KVROUTE_PORT": "tcp://10.96.12.34:8000",
    "KVROUTE_PORT_8000_TCP": "tcp://10.96.12.34:8000",
    "KVROUTE_PORT_8000_TCP_PROTO": "tcp",
    "KVROUTE_PORT_8000_TCP_PORT": "8000",
    "KVROUTE_PORT_8000_TCP_ADDR": "10.96.12.34",
    "KVROUTE_REDIS_SERVICE_HOST": "10.96.0.7",
    "KVROUTE_REDIS_SERVICE_PORT": "6379",
    "KVROUTE_REDIS_SERVICE_PORT_REDIS": "6379",
    "KVROUTE_REDIS_PORT": "tcp://10.96.0.7:6379",
    "KVROUTE_REDIS_PORT_6379_TCP": "tcp://10.96.0.7:6379",
    "KVROUTE_REDIS_PORT_6379_TCP_PROTO": "tcp",
    "KVROUTE_REDIS_PORT_6379_TCP_PORT": "6379",
    "KVROUTE_REDIS_PORT_6379_TCP_ADDR": "10.96.0.7",
}


@pytest.fixture
def service_links(monkeypatch: pytest.MonkeyPatch) -> None:
    """The links in this process's environment, which the children inherit."""
    for name, value in SERVICE_LINKS.items():
        monkeypatch.setenv(name, value)


async def test_serve_starts_and_answers_with_service_links_set(
    service_links: None, engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    # The constructor blocks until the router prints its address: keep this loop (and
    # so the in-process engine) running meanwhile.
    proc = await asyncio.to_thread(ServerProcess, "serve", ["--port", "0", "--engine", engine.url])
    try:
        async with http.get(f"{proc.url}/health") as resp:
            assert resp.status == 200
    finally:
        proc.stop()


def test_config_check_accepts_service_links(service_links: None, tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("engines:\n  - url: http://10.0.0.5:8000\n")
    done = subprocess.run(
        [sys.executable, "-m", "router", "config", "check", "--quiet", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stderr) == (0, "")
