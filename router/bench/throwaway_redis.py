"""A throw-away ``redis-server`` on loopback, for benchmarks and tests, and a way to see
what clients send it.

Never the machine's own Redis: the server gets a free port, no persistence
(``--save "" --appendonly no``), its own directory and its own process group, and
:meth:`RedisServer.kill` ends that group by id.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis

from router.process import start_group, stop_group


def free_port(below: int = 65536) -> int:
    """A TCP port under ``below`` that was free on loopback a moment ago."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port < below:
            return port


def wait_until_pingable(url: str, timeout: float = 10.0, **kwargs: object) -> None:
    """Poll ``PING`` until the server answers or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5, **kwargs)
    try:
        while True:
            try:
                if client.ping():
                    return
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.02)
    finally:
        client.close()


class RedisServer:
    """One ``redis-server`` process on loopback, owned by whoever started it."""

    def __init__(self, *extra_args: str, tls: bool = False, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not on the PATH")
        self.dir = Path(tempfile.mkdtemp(prefix="kvroute-redis-"))
        self.port = port or free_port()
        self.tls_files: dict[str, str] = {}
        args = [
            binary,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ]
        if tls:
            self.tls_files = make_tls_files(self.dir)
            args += [
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                self.tls_files["cert"],
                "--tls-key-file",
                self.tls_files["key"],
                "--tls-ca-cert-file",
                self.tls_files["ca"],
                "--tls-auth-clients",
                "no",
            ]
        else:
            args += ["--port", str(self.port)]
        args += list(extra_args)
        # Its own process group: signals reach it and nothing else.
        self.proc = start_group(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_until_pingable(self.url, **self.client_kwargs())
        except Exception:
            self.kill()
            raise

    @property
    def url(self) -> str:
        if self.tls_files:
            return f"rediss://127.0.0.1:{self.port}/0"
        return f"redis://127.0.0.1:{self.port}/0"

    def client_kwargs(self) -> dict[str, object]:
        """Extra client arguments this server needs (the CA for TLS)."""
        return {"ssl_ca_certs": self.tls_files["ca"]} if self.tls_files else {}

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open, nothing answers."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Unfreeze a paused server (SIGCONT)."""
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """Kill the server's process group (ours alone) and remove its directory."""
        stop_group(self.proc, grace=0, kill_wait=10.0)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def make_tls_files(directory: Path) -> dict[str, str]:
    """A throw-away CA and a server certificate for 127.0.0.1, made with ``openssl``."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise FileNotFoundError("openssl is not on the PATH")
    ca_key, ca = directory / "ca.key", directory / "ca.crt"
    key, csr, cert = directory / "server.key", directory / "server.csr", directory / "server.crt"
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True)

    run(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        "-subj", "/CN=kvroute-test-ca", "-keyout", str(ca_key), "-out", str(ca),
    )  # fmt: skip
    run(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", str(key), "-out", str(csr),
    )  # fmt: skip
    run(
        "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
        "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", str(cert),
    )  # fmt: skip
    return {"ca": str(ca), "cert": str(cert), "key": str(key)}


T = TypeVar("T")


def run_on_redis(redis_url: str | None, run: Callable[[str], Coroutine[Any, Any, T]]) -> T:
    """``run(url)`` to completion against ``redis_url``, or against a throw-away server
    started for it and killed afterwards; on uvloop where it is installed, as
    ``kvroute serve`` runs."""
    server = None if redis_url else RedisServer()
    url = redis_url or server.url  # type: ignore[union-attr]
    try:
        try:
            import uvloop
        except ImportError:
            return asyncio.run(run(url))
        return uvloop.run(run(url))
    finally:
        if server is not None:
            server.kill()


async def monitored_commands(
    url: str, action: Callable[[], Awaitable[object]], scripts: bool = False
) -> list[str]:
    """Commands that clients (not scripts) sent to Redis while ``action`` ran (MONITOR);
    with ``scripts``, the commands scripts ran instead.

    Marker ECHOs from another connection bracket the action, so commands of unrelated
    clients before or after do not count.
    """
    marker = uuid.uuid4().hex
    watcher = aioredis.Redis.from_url(url)
    other = aioredis.Redis.from_url(url)
    seen: list[str] = []
    try:
        async with watcher.monitor() as monitor:
            await other.echo(f"start-{marker}")
            await action()
            await other.echo(f"end-{marker}")

            async def collect() -> None:
                started = False
                async for info in monitor.listen():
                    command = info["command"]
                    if command == f"ECHO start-{marker}":
                        started = True
                    elif command == f"ECHO end-{marker}":
                        return
                    elif started and (info["client_type"] == "lua") == scripts:
                        seen.append(command)

            await asyncio.wait_for(collect(), 10)
    finally:
        await watcher.aclose()
        await other.aclose()
    return seen
