"""The emulator's KV-handoff wire protocol: length-prefixed msgpack maps over TCP.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack holding a
map. A client sends one request map with an ``op`` and reads one reply map per request;
a reply has ``ok: true`` and the op's fields, or ``ok: false`` with ``reason`` (a short
machine-readable word) and ``error`` (a sentence). One connection may carry several
requests in turn.

Frames larger than ``MAX_FRAME`` are refused, so a peer that is not an emulator (an
HTTP server answering ``HTTP/1.1 400``, say) fails at once with a clear error instead
of a long read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
import xxhash

from router.hashing import tokens_to_bytes

log = logging.getLogger(__name__)

MAX_FRAME = 1 << 24
_HEADER = 4

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode

#: Serves one request map; returns the reply map.
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class WireError(Exception):
    """The peer is unreachable, closed the connection, or does not speak this protocol."""


def prompt_digest(token_ids: Sequence[int], lora_name: str | None, cache_salt: str | None) -> int:
    """Identity of the KV a prompt produces: its tokens, adapter and salt.

    Both legs of a handoff compute it; a mismatch means the router paired the legs of
    different requests, and the KV would be another prompt's.
    """
    seed = xxhash.xxh3_64_intdigest(f"{lora_name or ''}\x00{cache_salt or ''}".encode())
    return xxhash.xxh3_64_intdigest(tokens_to_bytes(token_ids), seed)


async def write_frame(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    """Send one message as a frame."""
    payload = _encode(message)
    writer.write(len(payload).to_bytes(_HEADER, "big") + payload)
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next message, or None at a clean end of stream between frames."""
    try:
        header = await reader.readexactly(_HEADER)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise WireError("connection closed inside a frame header") from None
    size = int.from_bytes(header, "big")
    if size > MAX_FRAME:
        raise WireError(f"frame of {size} bytes announced: the peer does not speak this protocol")
    try:
        message = _decode(await reader.readexactly(size))
    except asyncio.IncompleteReadError:
        raise WireError("connection closed inside a frame") from None
    except msgspec.DecodeError as exc:
        raise WireError(f"undecodable frame: {exc}") from None
    if not isinstance(message, dict):
        raise WireError("a frame must hold a map")
    return message


def failure(reason: str, error: str) -> dict[str, Any]:
    """A reply saying the request failed."""
    return {"ok": False, "reason": reason, "error": error}


class Connection:
    """A client connection: ``request`` sends a map and returns the reply map."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, host: str, port: int, timeout: float) -> Connection:
        """Connect within ``timeout`` seconds; ``WireError`` if nobody answers."""
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise WireError(f"cannot connect to {host}:{port}: {exc or 'timed out'}") from None
        return cls(reader, writer)

    async def request(self, message: dict[str, Any], timeout: float | None) -> dict[str, Any]:
        """Send ``message`` and return the reply (``timeout`` None: wait for it)."""
        try:
            await write_frame(self._writer, message)
            reply = await asyncio.wait_for(read_frame(self._reader), timeout)
        except OSError as exc:
            raise WireError(f"connection failed: {exc}") from None
        except asyncio.TimeoutError:
            raise WireError(f"no reply within {timeout:g} s") from None
        if reply is None:
            raise WireError("the peer closed the connection without replying")
        if not isinstance(reply.get("ok"), bool):
            raise WireError("the reply is not a kvroute handoff reply")
        return reply

    async def close(self) -> None:
        """Close the connection."""
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()


async def call(host: str, port: int, message: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One request on a fresh connection, within ``timeout`` seconds overall."""
    conn = await Connection.open(host, port, timeout)
    try:
        return await conn.request(message, timeout)
    finally:
        await conn.close()


class Listener:
    """A TCP server answering request maps with ``handler``, one task per connection."""

    def __init__(self, name: str, handler: Handler) -> None:
        self.name = name
        self._handler = handler
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.host = ""
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        """Bind ``host:port`` (port 0: a free one, then in ``self.port``)."""
        self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True)
        self.host = host
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while True:
                try:
                    message = await read_frame(reader)
                except WireError as exc:
                    log.warning("%s: dropping a connection: %s", self.name, exc)
                    return
                if message is None:
                    return
                await write_frame(writer, await self._handler(message))
        except OSError:
            return  # the peer left; nothing to answer
        finally:
            self._connections.discard(task)
            writer.close()

    async def stop(self) -> None:
        """Stop listening and end the connections being served."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(asyncio.CancelledError):
                await task
