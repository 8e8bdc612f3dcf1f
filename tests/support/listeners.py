"""Loopback listeners that stand for hosts a router or an engine must never reach."""

from __future__ import annotations

import asyncio


class DialCounter:
    """A listener on 127.0.0.2 (another host, as far as the engines know) that counts
    the connections made to it: where a client-supplied handoff would make an engine
    pull KV from, or push it to."""

    def __init__(self) -> None:
        self.dials = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.dials += 1
            writer.close()

        self.server = await asyncio.start_server(accepted, "127.0.0.2", 0)
        return self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


def hostile_handoff(port: int) -> dict[str, object]:
    """A client's own handoff fields, naming the counter as the KV source."""
    return {
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "x",
            "remote_block_ids": [[1]],
            "remote_host": "127.0.0.2",
            "remote_port": port,
            "remote_request_id": "r",
        },
        "bootstrap_host": "127.0.0.2",
        "bootstrap_port": port,
        "bootstrap_room": 12345,
    }
