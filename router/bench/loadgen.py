"""A load generator for OpenAI-compatible endpoints (kvroute, an engine, another router).

It sends :class:`RequestSpec` s closed-loop (a fixed number in flight) or on a schedule
(each spec's ``at`` offset), streams by default, and records per request what routing
is judged by: the engine that served it (``x-kvroute-engine``), the cached prompt
tokens the engine reported, time to first token, inter-token gaps, end-to-end time.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from router.bench.apis import APIS
from router.workloads.spec import RequestSpec
from router.workloads.stats import percentile

_decode = msgspec.json.decode
_encode = msgspec.json.encode


@dataclass(slots=True)
class Result:
    """What one request did, as the client saw it."""

    spec: RequestSpec
    status: int = 0
    engine: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    error: str = ""
    text: str = ""
    sent_at: float = 0.0
    """Seconds after the run started that the request was sent."""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


async def sse_data(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The ``data:`` payload of every server-sent event of a streamed answer, in order
    (``b"[DONE]"`` included; an ``event:`` line before it, as Anthropic's, is skipped);
    events without data are skipped."""
    buffer = b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):  # after an ``event:`` line, as Responses sends
                if line.startswith(b"data: "):
                    yield line[6:]


def request_body(
    spec: RequestSpec, *, stream: bool, model: str | None = None, api: str = "openai"
) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of ``spec`` in ``api`` (:data:`router.bench.apis.APIS`;
    ``openai``: ``/v1/completions`` or ``/v1/chat/completions``, a streamed one asking
    for usage in its last chunk)."""
    return APIS[api].request(spec, stream=stream, model=model)


async def _one(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str | None,
    spec: RequestSpec,
    stream: bool,
    headers: dict[str, str],
    api: str = "openai",
) -> Result:
    result = Result(spec)
    reader = APIS[api]
    path, body = reader.request(spec, stream=stream, model=model)
    url = base_url + path
    started = time.perf_counter()
    last = started
    pieces: list[str] = []
    try:
        async with session.post(url, data=_encode(body), headers=headers) as resp:
            result.status = resp.status
            result.engine = resp.headers.get("x-kvroute-engine", "")
            if resp.status != 200:
                result.error = (await resp.read())[:300].decode("utf-8", "replace")
                return result
            if not stream:
                pieces.append(reader.answer(result, _decode(await resp.read())))
            else:
                async for data in sse_data(resp):
                    if data == b"[DONE]":
                        continue
                    payload = _decode(data)
                    if "error" in payload:  # OpenAI's and Anthropic's error events
                        result.error = str(payload["error"].get("message", "stream error"))
                        continue
                    text = reader.event(result, payload)
                    if text:
                        now = time.perf_counter()
                        if result.ttft is None:
                            result.ttft = now - started
                        else:
                            result.itl.append(now - last)
                        last = now
                        pieces.append(text)
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, msgspec.DecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e = time.perf_counter() - started
    if result.ttft is None and result.ok:
        result.ttft = result.e2e
    result.text = "".join(pieces)
    return result


async def run_load(
    base_url: str,
    specs: Iterable[RequestSpec],
    *,
    concurrency: int = 8,
    model: str | None = None,
    stream: bool = True,
    timeout: float = 300.0,
    headers: dict[str, str] | None = None,
    on_result: Callable[[Result], None] | None = None,
    stop_after: float | None = None,
    api: str = "openai",
) -> list[Result]:
    """Send every spec, closed loop with ``concurrency`` slots or at each spec's ``at``,
    to the OpenAI routes (``api`` ``openai``) or as Anthropic Messages (``messages``,
    :mod:`router.bench.messages`).

    With ``stop_after``, nothing more is sent once that many seconds have passed (what
    is in flight finishes).

    A spec with ``then`` starts a session (a user's conversation): it keeps its slot,
    and after each answer ``then(answer text)`` gives the next request, sent ``delay``
    seconds later, until it returns None or a request fails. Results come back session
    by session, in the order of ``specs``, each session's requests in order.
    """
    items = list(specs)
    sessions: list[list[Result]] = [[] for _ in items]
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    connector = aiohttp.TCPConnector(limit=0)
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session:
        started = time.perf_counter()
        slots = asyncio.Semaphore(concurrency)

        async def send(i: int) -> None:
            spec: RequestSpec | None = items[i]
            assert spec is not None
            if spec.at is not None:
                delay = spec.at - (time.perf_counter() - started)
                if delay > 0:
                    await asyncio.sleep(delay)
            async with slots:
                while spec is not None:
                    sent_at = time.perf_counter() - started
                    if stop_after is not None and sent_at > stop_after:
                        break
                    result = await _one(session, base_url, model, spec, stream, hdrs, api)
                    result.sent_at = sent_at
                    sessions[i].append(result)
                    if on_result is not None:
                        on_result(result)
                    if spec.then is None or not result.ok:
                        break
                    spec = spec.then(result.text)
                    if spec is not None and spec.delay > 0:
                        await asyncio.sleep(spec.delay)

        await asyncio.gather(*(send(i) for i in range(len(items))))
    return [r for results in sessions for r in results]


# ------------------------------------------------------------------------------ summaries


@dataclass(slots=True)
class Summary:
    requests: int
    errors: int
    hit_rate: float
    """Cached prompt tokens over prompt tokens, as the engines reported."""
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    e2e_p50: float
    per_engine: dict[str, tuple[int, float]]
    """engine -> (requests, cached-token ratio)."""
    group_affinity: float
    """Mean share of each group's requests that went to that group's busiest engine."""


def summarize(results: Sequence[Result]) -> Summary:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    per_engine: dict[str, list[Result]] = defaultdict(list)
    groups: dict[str, list[str]] = defaultdict(list)
    for r in ok:
        per_engine[r.engine or "?"].append(r)
        groups[r.spec.group].append(r.engine)
    table = {
        engine: (
            len(rs),
            sum(r.cached_tokens for r in rs) / max(sum(r.prompt_tokens for r in rs), 1),
        )
        for engine, rs in sorted(per_engine.items())
    }
    shares = [
        max(engines.count(e) for e in set(engines)) / len(engines)
        for engines in groups.values()
        if engines
    ]
    itl = [gap for r in ok for gap in r.itl]
    return Summary(
        requests=len(results),
        errors=len(results) - len(ok),
        hit_rate=cached / prompt if prompt else 0.0,
        ttft_p50=percentile([r.ttft for r in ok if r.ttft is not None], 50),
        ttft_p99=percentile([r.ttft for r in ok if r.ttft is not None], 99),
        itl_p50=percentile(itl, 50),
        e2e_p50=percentile([r.e2e for r in ok], 50),
        per_engine=table,
        group_affinity=statistics.mean(shares) if shares else 0.0,
    )
