"""KV events on the wire, as vLLM's ``ZmqEventPublisher`` sends them.

* PUB socket, multipart ``[topic, seq (8-byte big-endian, from 0), payload]``; the
  payload is ``router.events.vllm.encode_batch`` in the configured shape.
* The PUB binds when the endpoint holds ``*`` or ``::`` or is ``ipc://``/``inproc://``,
  and connects otherwise (llm-d's central mode: one router SUB binds, engines connect);
  a connecting PUB may carry CURVE keys for a router that asks for them
  (:mod:`router.events.publishers`).
* Optional replay ROUTER (always bound): a DEALER sends ``[b"", start_seq]`` and gets
  ``[b"", topic, seq, payload]`` for each buffered batch with ``seq >= start_seq``, then
  ``[b"", b"", 0xFF*8, b""]`` (vLLM 0.32; ``replay_frames="legacy"``: older releases'
  ``[b"", seq, payload]`` and ``[b"", 0xFF*8, b""]``). Only the last 10,000 batches are
  kept.

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

import msgspec
import zmq
import zmq.asyncio

from router.emulator.faults import Faults
from router.events.publishers import PublisherCurve
from router.events.sglang import as_sglang_sends, encode_sglang_batch
from router.events.trtllm import as_trtllm_events, encode_trtllm_batch
from router.events.types import BlockRemoved, BlockStored, KVEvent
from router.events.vllm import (
    END_SEQ,
    SEQ_BYTES,
    EventFormat,
    ReplayFrames,
    encode_batch,
    encode_seq,
)

log = logging.getLogger(__name__)

#: Batches kept for replay (vLLM's ``buffer_steps``).
REPLAY_BUFFER = 10_000
PUB_HWM = 100_000
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


def as_vllm_sends(events: Sequence[KVEvent]) -> list[KVEvent]:
    """The model's events as vLLM 0.32 puts them on the wire: one ``BlockRemoved`` per
    evicted block, and the KV-cache group fields a plain model's events carry
    (``group_idx`` 0, ``kv_cache_spec_kind`` ``full_attention``, one ``extra_keys`` entry
    per block, null without LoRA or multimodal keys)."""
    out: list[KVEvent] = []
    for event in events:
        if isinstance(event, BlockRemoved):
            group = 0 if event.group_idx is None else event.group_idx
            out.extend(BlockRemoved([h], event.medium, group) for h in event.block_hashes)
        elif isinstance(event, BlockStored):
            out.append(
                msgspec.structs.replace(
                    event,
                    extra_keys=event.extra_keys
                    if event.extra_keys is not None
                    else [None] * len(event.block_hashes),
                    group_idx=0 if event.group_idx is None else event.group_idx,
                    kv_cache_spec_kind=event.kv_cache_spec_kind or "full_attention",
                )
            )
        else:
            out.append(event)
    return out


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
        wire_format: EventFormat,
        replay_endpoint: str | None = None,
        data_parallel_rank: int = 0,
        faults: Faults | None = None,
        replay_frames: ReplayFrames = "topic",
        buffer_steps: int = REPLAY_BUFFER,
        curve: PublisherCurve | None = None,
    ) -> None:
        """``curve``: the keys to publish with to a router whose bound socket asks for
        CURVE (a connecting publisher only)."""
        if buffer_steps < 1:
            raise ValueError("buffer_steps must be at least 1")
        if curve is not None and binds(endpoint):
            raise ValueError("CURVE keys are for a publisher that connects to a router")
        self.topic = topic
        self.buffer_steps = buffer_steps
        # SGLang's replay answers in the older frames whatever was asked for.
        self.replay_frames: ReplayFrames = "legacy" if wire_format == "sglang" else replay_frames
        self.wire_format = wire_format
        self.data_parallel_rank = data_parallel_rank
        self._faults = faults
        self._topic = topic.encode()
        self._seq = 0
        self._event_id = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        # A plain (blocking-API) socket on the asyncio context: PUB sends never block.
        self._pub = zmq.Socket(ctx, zmq.PUB)
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, PUB_HWM)
            if binds(endpoint):
                self._pub.bind(endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                if curve is not None:
                    curve.secure(self._pub)
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            self.replay_endpoint: str | None = None
            if replay_endpoint:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, buffer_steps + 16)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self.close()
            raise

    def start(self) -> None:
        """Start answering replay requests (needs a running event loop)."""
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    @property
    def published(self) -> int:
        """The batches published so far."""
        return self._seq

    def publish(self, events: Sequence[KVEvent], ts: float) -> None:
        """Send one batch now and keep it for replay."""
        if self.wire_format == "sglang":
            payload = encode_sglang_batch(as_sglang_sends(events), ts, self.data_parallel_rank)
        elif self.wire_format == "trtllm":
            listed = as_trtllm_events(events, self._event_id, 0, self.data_parallel_rank or None)
            self._event_id += len(listed)
            if not listed:
                return
            payload = encode_trtllm_batch(listed)
        else:
            payload = encode_batch(
                as_vllm_sends(events), ts, self.data_parallel_rank, self.wire_format
            )
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
            # vLLM 0.32 puts the topic before the seq (an empty topic in the end marker).
            topic = (self._topic,) if self.replay_frames == "topic" else ()
            end_topic = (b"",) if self.replay_frames == "topic" else ()
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await sock.send_multipart((ident, b"", *topic, encode_seq(seq), payload))
            await sock.send_multipart((ident, b"", *end_topic, END_SEQ, b""))

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
