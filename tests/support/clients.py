"""Small HTTP and ZMQ clients for talking to engines in tests."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from router.events.types import EventBatch
from router.events.vllm import END_SEQ, decode_batch, decode_seq, encode_seq

#: A test's HTTP exchange (connecting, sending, reading the whole answer) fails after
#: this long. aiohttp's own default, 300 s, outlasts a test's time limit: a server that
#: stalled then stopped the run instead of failing the test.
REQUEST_TIMEOUT_S = 30.0


def session(**kwargs: Any) -> aiohttp.ClientSession:
    """An aiohttp session for tests: each request fails after ``REQUEST_TIMEOUT_S``
    unless ``timeout`` says otherwise."""
    kwargs.setdefault("timeout", aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))
    return aiohttp.ClientSession(**kwargs)


async def post(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """POST JSON (or raw bytes) and return (status, decoded JSON body or None)."""
    if isinstance(body, bytes):
        data = body
    else:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **(headers or {})}
    async with http.post(url, data=data, headers=headers) as resp:
        raw = await resp.read()
        return resp.status, json.loads(raw) if raw else None


@dataclass
class Reply:
    """A whole HTTP answer: status, headers and decoded JSON body (None if empty)."""

    status: int
    headers: dict[str, str]
    body: Any


async def post_reply(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> Reply:
    """POST JSON and return the status, the headers (lower-case names) and the body."""
    async with http.post(url, json=body, headers=headers) as resp:
        raw = await resp.read()
        names = {k.lower(): v for k, v in resp.headers.items()}
        return Reply(resp.status, names, json.loads(raw) if raw else None)


async def get(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url) as resp:
        raw = await resp.read()
        return resp.status, json.loads(raw) if raw else None


async def stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[Any]:
    """POST a streaming request; return each SSE ``data:`` payload (``"[DONE]"`` verbatim)."""
    return (await stream_reply(http, url, body)).body


async def stream_reply(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> Reply:
    """POST a streaming request; the body is the list of SSE ``data:`` payloads."""
    out: list[Any] = []
    async with http.post(url, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["content-type"].startswith("text/event-stream")
        names = {k.lower(): v for k, v in resp.headers.items()}
        text = (await resp.read()).decode()
    for block in text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            payload = block[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return Reply(200, names, out)


async def metrics(http: aiohttp.ClientSession, base_url: str) -> dict[str, list[Any]]:
    """Samples of /metrics by sample name, parsed with prometheus_client's parser."""
    async with http.get(f"{base_url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def metric(samples: dict[str, list[Any]], name: str) -> float:
    """The value of a metric with a single sample."""
    (sample,) = samples[name]
    return sample.value


def metric_sum(samples: dict[str, list[Any]], name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include ``labels`` (0 if none)."""
    return sum(
        s.value
        for s in samples.get(name, [])
        if all(s.labels.get(k) == v for k, v in labels.items())
    )


@dataclass
class Message:
    topic: bytes
    seq: int
    payload: bytes

    @property
    def batch(self) -> EventBatch:
        return decode_batch(self.payload)


class Subscriber:
    """A ZMQ SUB socket (connecting, or binding for llm-d's central topology)."""

    def __init__(self, endpoint: str, bind: bool = False) -> None:
        self._ctx = zmq.asyncio.Context()
        self.sock = self._ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        if bind:
            self.sock.bind(endpoint)
            self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.sock.connect(endpoint)
            self.endpoint = endpoint

    async def recv(self, timeout: float = 5.0) -> Message:
        frames = await asyncio.wait_for(self.sock.recv_multipart(), timeout)
        topic, seq, payload = frames
        return Message(topic, decode_seq(seq), payload)

    async def sync(self, http: aiohttp.ClientSession, engine_url: str) -> Message:
        """Wait until the subscription is live (ZMQ's slow joiner).

        Each probe is a prefix-cache reset, which publishes one batch; the first probe
        that arrives proves later batches will too. Returns that probe's message.
        """
        for _ in range(200):
            status, _ = await post(http, f"{engine_url}/reset_prefix_cache", {})
            assert status == 200
            try:
                return await self.recv(timeout=0.05)
            except asyncio.TimeoutError:
                continue
        raise AssertionError("subscription never became live")

    def close(self) -> None:
        self.sock.close(linger=0)
        self._ctx.term()


async def replay(
    endpoint: str, start_seq: int, timeout: float = 5.0, topics: list[bytes] | None = None
) -> list[tuple[bytes, bytes]]:
    """Ask a replay ROUTER for batches from ``start_seq``; returns every reply up to and
    including the end marker, as (seq frame, payload). Replies may be vLLM 0.32's
    ``[b"", topic, seq, payload]`` or older releases' ``[b"", seq, payload]``; the topic
    frames are appended to ``topics`` when given."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        await sock.send_multipart([b"", encode_seq(start_seq)])
        replies: list[tuple[bytes, bytes]] = []
        while True:
            frames = await asyncio.wait_for(sock.recv_multipart(), timeout)
            assert frames[0] == b"" and len(frames) in (3, 4), frames
            seq, payload = frames[-2:]
            if topics is not None and len(frames) == 4:
                topics.append(frames[1])
            replies.append((seq, payload))
            if seq == END_SEQ:
                return replies
    finally:
        sock.close(linger=0)
        ctx.term()
