"""A vLLM-style KV-event publisher for tests, speaking the engine's wire protocol.

PUB ``[topic, seq, payload]`` and a ROUTER replay socket, as vLLM runs them, with knobs
a real engine lacks: publish a batch to the replay buffer without sending it (a forced
gap), forget old batches, restart from sequence 0, send garbage.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import zmq
import zmq.asyncio

from router.events.types import KVEvent
from router.events.vllm import END_SEQ, ReplayFrames, decode_seq, encode_batch, encode_seq


class Publisher:
    """A vLLM-style publisher with fault knobs."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        pub: str,
        replay: str,
        connect: bool = False,
        replay_frames: ReplayFrames = "topic",
    ) -> None:
        self.replay_frames = replay_frames
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if connect:
            self.pub.connect(pub)
            self.pub_endpoint = pub
        else:
            self.pub.bind(pub)
            self.pub_endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(replay)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=10_000)
        self.answer_replays = True
        """False: replay requests go unanswered (an engine too busy, or still starting)."""
        self.seq = 0
        self.topic = b""
        self._task = asyncio.ensure_future(self._serve_replay())

    async def publish(
        self, events: list[KVEvent], send: bool = True, rank: int | None = None
    ) -> int:
        seq = self.seq
        self.seq += 1
        payload = encode_batch(events, time.time(), rank)
        self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart([self.topic, encode_seq(seq), payload])
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    def restart(self) -> None:
        self.seq = 0
        self.buffer.clear()

    async def _serve_replay(self) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            if not self.answer_replays:
                continue
            first = decode_seq(start)
            # vLLM 0.32: [b"", topic, seq, payload] ... [b"", b"", END, b""]; older: no topic.
            topic = [self.topic] if self.replay_frames == "topic" else []
            end_topic = [b""] if self.replay_frames == "topic" else []
            for seq, payload in list(self.buffer):
                if seq >= first:
                    await self.router.send_multipart([ident, b"", *topic, encode_seq(seq), payload])
            await self.router.send_multipart([ident, b"", *end_topic, END_SEQ, b""])

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.pub.close(0)
        self.router.close(0)
