"""Redis for tests: a throw-away local ``redis-server``, ``REDIS_URL``, or a container.

The local server (``router.bench.throwaway_redis``) is never the machine's own Redis
and is killed by id when the test session ends. ``REDIS_URL`` points the tests at a
server you run yourself (tests then keep to random namespaces and delete their keys).
Without either, testcontainers is used when a Docker daemon answers within half a
second.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator

import redis

from router.bench.throwaway_redis import RedisServer, free_port, monitored_commands

__all__ = [
    "RedisServer",
    "delete_namespace",
    "docker_answers",
    "monitored_commands",
    "random_namespace",
    "redis_cluster",
    "session_redis_url",
]

REDIS_URL_ENV = "REDIS_URL"


def random_namespace() -> str:
    """A key namespace no other test (or user of a shared ``REDIS_URL``) uses."""
    return f"kvtest-{uuid.uuid4().hex[:12]}"


def docker_answers(timeout: float = 0.5) -> bool:
    """Whether a Docker daemon answers ``/_ping`` on its Unix socket within ``timeout``."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not host.startswith("unix://"):
        return False
    path = host[len("unix://") :]
    if not os.path.exists(path):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            status = sock.recv(64).split(b"\r\n", 1)[0]
            return status.startswith(b"HTTP/1.") and b" 200" in status
    except OSError:
        return False


@contextlib.contextmanager
def session_redis_url() -> Iterator[str | None]:
    """The URL tests should use, starting a server if needed; None when none is available."""
    url = os.environ.get(REDIS_URL_ENV)
    if url:
        yield url
        return
    if shutil.which("redis-server"):
        server = RedisServer()
        try:
            yield server.url
        finally:
            server.kill()
        return
    if docker_answers():
        try:
            from testcontainers.redis import RedisContainer  # type: ignore[import-not-found]
        except ImportError:
            yield None
            return
        with RedisContainer("redis:7.0") as container:
            host = container.get_container_host_ip()
            port = container.get_exposed_port(6379)
            yield f"redis://{host}:{port}/0"
        return
    yield None


def delete_namespace(url: str, namespace: str) -> None:
    """Delete every key of ``namespace`` (all of them share the ``{namespace}`` hash tag)."""
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        batch = list(client.scan_iter(match=f"{{{namespace}}}:*", count=1000))
        for start in range(0, len(batch), 1000):
            client.unlink(*batch[start : start + 1000])
    finally:
        client.close()


def cluster_port() -> int:
    """A free port whose cluster-bus port (port + 10000) was free a moment ago too: a
    node whose bus port is taken (say by a client socket's ephemeral port) exits."""
    while True:
        port = free_port(below=55536)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


@contextlib.contextmanager
def redis_cluster(nodes: int = 3) -> Iterator[list[RedisServer]]:
    """A throw-away Redis Cluster of ``nodes`` primaries, slots split evenly between them.

    Slots are assigned and nodes introduced directly (``CLUSTER ADDSLOTSRANGE`` and
    ``MEET``), which takes a fraction of the time ``redis-cli --cluster create`` needs.
    """
    servers: list[RedisServer] = []
    try:
        for _ in range(nodes):
            servers.append(
                RedisServer(
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    port=cluster_port(),
                )
            )  # fmt: skip
        clients = [redis.Redis(port=s.port, socket_timeout=5) for s in servers]
        per = 16384 // nodes
        for i, client in enumerate(clients):
            last = 16383 if i == nodes - 1 else (i + 1) * per - 1
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, last)
            if i:
                client.execute_command("CLUSTER", "MEET", "127.0.0.1", servers[0].port)
        deadline = time.monotonic() + 20
        while not all(c.cluster("info").get("cluster_state") == "ok" for c in clients):
            if time.monotonic() > deadline:
                raise TimeoutError("the test cluster did not come up")
            time.sleep(0.02)
        for client in clients:
            client.close()
        yield servers
    finally:
        for server in servers:
            server.kill()
