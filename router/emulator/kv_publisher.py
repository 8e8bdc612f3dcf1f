"""KV events on the wire, as vLLM's ``ZmqEventPublisher`` sends them.

* PUB socket, multipart ``[topic, seq (8-byte big-endian, from 0), payload]``; the
  payload is ``router.events.vllm.encode_batch`` in the configured shape.
* The PUB binds when the endpoint holds ``*`` or ``::`` or is ``ipc://``/``inproc://``,
  and connects otherwise (llm-d's central mode: one router SUB binds, engines connect).
* Optional replay ROUTER (always bound): a DEALER sends ``[b"", start_seq]`` and gets
  ``[b"", seq, payload]`` for each buffered batch with ``seq >= start_seq``, then
  ``[b"", 0xFF*8, b""]``. Only the last 10,000 batches are kept.

Every socket has LINGER 0 so that stopping never waits for absent peers.

With data-parallel ranks each rank has its own publisher on ``rank_endpoint``: vLLM's
port + rank for TCP, a ``_dp<rank>`` suffix for ``ipc://`` and ``inproc://``.

Two faults (``Faults``) are for subscribers' tests: a skipped batch is numbered and kept
for replay but never sent on the PUB socket (a gap), and a garbage message
``[topic, b"kvroute-garbage", b"\xc1"]`` (a 15-byte sequence frame, and a payload that
is not msgpack) goes out before a batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from router.emulator.faults import Faults
from router.events.types import KVEvent
from router.events.vllm import END_SEQ, SEQ_BYTES, WireFormat, encode_batch, encode_seq

log = logging.getLogger(__name__)

#: Batches kept for replay (vLLM's ``buffer_steps``).
REPLAY_BUFFER = 10_000
_PUB_HWM = 100_000
#: The malformed message of the ``kv_events_garbage`` fault (after the topic frame).
GARBAGE_FRAMES = (b"kvroute-garbage", b"\xc1")


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of data-parallel rank ``rank`` (vLLM's ``offset_endpoint_port``).

    TCP ports are offset by the rank; a wildcard port (``*``) stays a wildcard, so each
    rank binds its own free port. ``ipc://`` and ``inproc://`` paths get ``_dp<rank>``.
    """
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if port == "*":
            return endpoint
        if not port.isdigit():
            raise ValueError(f"tcp endpoint without a port: {endpoint!r}")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and local-transport endpoints, connect to the rest."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


class KVEventPublisher:
    """One engine rank's event stream and its replay service."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        topic: str,
        wire_format: WireFormat,
        replay_endpoint: str | None = None,
        data_parallel_rank: int = 0,
        faults: Faults | None = None,
    ) -> None:
        self.topic = topic
        self.wire_format = wire_format
        self.data_parallel_rank = data_parallel_rank
        self._faults = faults
        self._topic = topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BUFFER)
        # A plain (blocking-API) socket on the asyncio context: PUB sends never block.
        self._pub = zmq.Socket(ctx, zmq.PUB)
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, _PUB_HWM)
            if binds(endpoint):
                self._pub.bind(endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            self.replay_endpoint: str | None = None
            if replay_endpoint:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, REPLAY_BUFFER + 16)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self.close()
            raise

    def start(self) -> None:
        """Start answering replay requests (needs a running event loop)."""
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: Sequence[KVEvent], ts: float) -> None:
        """Send one batch now and keep it for replay."""
        payload = encode_batch(events, ts, self.data_parallel_rank, self.wire_format)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        faults = self._faults
        if faults is not None:
            if faults.take_kv_garbage():
                self._pub.send_multipart((self._topic, *GARBAGE_FRAMES), flags=zmq.NOBLOCK)
            if faults.take_kv_skip():
                return
        self._pub.send_multipart((self._topic, encode_seq(seq), payload), flags=zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        sock = self._replay
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != SEQ_BYTES:
                log.warning("ignoring malformed replay request of %d frames", len(frames))
                continue
            ident, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await sock.send_multipart((ident, b"", encode_seq(seq), payload))
            await sock.send_multipart((ident, b"", END_SEQ, b""))

    async def aclose(self) -> None:
        """Stop the replay service and close the sockets."""
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        self.close()

    def close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
