"""gRPC clients for tests: kvroute.v1 stubs, health checks, SSE payloads of Generate."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.grpc.gen.kvroute.v1 import router_pb2 as pb
from router.grpc.gen.kvroute.v1 import router_pb2_grpc as pb_grpc


@dataclass
class Stubs:
    channel: aio.Channel
    router: pb_grpc.RouterStub
    admin: pb_grpc.AdminStub
    health: health_pb2_grpc.HealthStub


@asynccontextmanager
async def connect(port: int) -> AsyncIterator[Stubs]:
    """Stubs on a loopback channel to ``port``."""
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield Stubs(
            channel,
            pb_grpc.RouterStub(channel),
            pb_grpc.AdminStub(channel),
            health_pb2_grpc.HealthStub(channel),
        )


async def health_status(stub: health_pb2_grpc.HealthStub, service: str) -> str:
    """``SERVING`` / ``NOT_SERVING`` / ... of one service (grpc.health.v1 Check)."""
    answer = await stub.Check(health_pb2.HealthCheckRequest(service=service))
    return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)


async def rpc_error(call: Any) -> tuple[grpc.StatusCode, str]:
    """Await a call that must fail; return its status code and message."""
    try:
        result = await call
    except aio.AioRpcError as err:
        return err.code(), err.details() or ""
    raise AssertionError(f"expected an error, got {result}")


@dataclass
class Generated:
    """A whole Generate stream: the head of the first chunk and the bytes of all."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    data: bytes = b""
    chunks: int = 0

    def events(self) -> list[Any]:
        """SSE ``data:`` payloads (``"[DONE]"`` verbatim, the rest decoded)."""
        out: list[Any] = []
        for block in self.data.decode().split("\n\n"):
            if block:
                assert block.startswith("data: "), block
                payload = block[len("data: ") :]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
        return out


async def generate(
    router: pb_grpc.RouterStub, body: dict[str, Any] | bytes, **fields: Any
) -> Generated:
    """Run Generate to its end (``body``: the request, or its bytes as sent)."""
    out = Generated()
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = pb.GenerateRequest(body=raw, **fields)
    async for chunk in router.Generate(request):
        if out.chunks == 0:
            out.status, out.headers = chunk.status, dict(chunk.headers)
        out.data += chunk.data
        out.chunks += 1
    return out


def streamed_text(events: list[Any]) -> str:
    return "".join(
        e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices")
    )
