"""The soak's requests: the mix it sends, one strict sender, and the capacity ramp.

:func:`send` judges an answer as :mod:`router.bench.soak.report` counts it (answered, a
clean error, or lost); it builds its requests and reads streams with
:mod:`router.bench.loadgen`'s :func:`~router.bench.loadgen.request_body` and
:func:`~router.bench.loadgen.sse_data`, whose sender measures rather than judges.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import msgspec

from router.bench.loadgen import request_body, sse_data
from router.bench.soak.report import Outcome, RampStep
from router.workloads.generated import words
from router.workloads.spec import RequestSpec
from router.workloads.stats import percentile

RAMP_LEVELS = (2, 4, 8, 16, 32, 64, 128)


class RequestMix:
    """Deterministic requests over shared system prompts, in four shapes.

    Prompt groups are drawn with Zipf-like popularity (a few hot system prompts, a long
    tail); each request ends in its own question and asks for 8 to 64 tokens.
    """

    #: (kind, streamed, share)
    SHAPES = (
        ("completion", True, 0.45),
        ("completion", False, 0.20),
        ("chat", True, 0.25),
        ("chat", False, 0.10),
    )

    def __init__(self, seed: int = 0, groups: int = 24) -> None:
        self.rng = random.Random(seed)
        self.prefixes = [
            words(self.rng, self.rng.randint(200, 800), f"s{g}x") for g in range(groups)
        ]
        self.weights = [1 / (g + 1) ** 0.8 for g in range(groups)]

    def next(self) -> RequestSpec:
        rng = self.rng
        (g,) = rng.choices(range(len(self.prefixes)), self.weights)
        kind, stream, _ = rng.choices(self.SHAPES, [s[2] for s in self.SHAPES])[0]
        question = words(rng, rng.randint(8, 48), "q")
        extra: dict[str, Any] = {"stream": stream}
        spec = RequestSpec(max_tokens=rng.randint(8, 64), group=f"s{g}", extra=extra)
        if kind == "chat":
            spec.messages = [
                {"role": "system", "content": self.prefixes[g]},
                {"role": "user", "content": question},
            ]
        else:
            spec.prompt = f"{self.prefixes[g]} {question}"
        return spec


_decode = msgspec.json.decode
_encode = msgspec.json.encode
_HEADERS = {"Content-Type": "application/json"}


def error_label(payload: Any, status: int | None = None) -> str | None:
    """How a failure is counted: ``http-STATUS`` for an error answer, ``sse-CODE`` for an
    SSE error event (``status`` None), plus the error's code when it is a word; None when
    ``payload`` is not an OpenAI error (``{"error": {"message": ..., ...}}``)."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return None
    code = error.get("code")
    if status is not None:
        label = f"http-{status}"
    else:
        label = f"sse-{code}" if isinstance(code, int) else "sse"
    return f"{label} {code}" if isinstance(code, str) else label


async def read_stream(resp: aiohttp.ClientResponse, out: Outcome) -> None:
    """Judge a streamed answer into ``out``: answered when it ends with ``[DONE]``, a
    clean error when its error event is in OpenAI's form and ``[DONE]`` follows."""
    done = False
    error: Any = None
    async for data in sse_data(resp):
        if data == b"[DONE]":
            done = True
            continue
        payload = _decode(data)
        if isinstance(payload, dict) and "error" in payload:
            error = payload
    if error is None:
        out.answered = done
        out.reason, out.lost = ("", False) if done else ("stream ended without [DONE]", True)
        return
    label = error_label(error)
    if label is None:
        out.reason, out.lost = "SSE error event not in OpenAI's form", True
    elif not done:
        out.reason, out.lost = f"{label} without [DONE] after it", True
    else:
        out.reason = label


async def send(
    session: aiohttp.ClientSession, url: str, spec: RequestSpec, origin: float
) -> Outcome:
    """Send one request and judge its answer strictly (see :class:`Outcome`).

    Stricter than :mod:`router.bench.loadgen`, which measures: a stream must end with
    ``[DONE]``, an error must be in OpenAI's form, and anything else counts as lost.
    """
    chat = spec.messages is not None
    stream = bool(spec.extra.get("stream"))
    out = Outcome(
        time.monotonic() - origin, ("chat" if chat else "completion") + "-stream" * stream
    )
    path, body = request_body(spec, stream=stream)
    try:
        async with session.post(url + path, data=_encode(body), headers=_HEADERS) as resp:
            out.status = resp.status
            out.engine = resp.headers.get("x-kvroute-engine", "")
            if resp.status != 200:
                data = await resp.read()
                try:
                    label = error_label(_decode(data), resp.status)
                except msgspec.DecodeError:
                    label = None
                if label is None:
                    out.reason, out.lost = f"http-{resp.status} without an OpenAI error body", True
                else:
                    out.reason = label
            elif stream:
                await read_stream(resp, out)
            else:
                payload = _decode(await resp.read())
                if isinstance(payload, dict) and payload.get("choices"):
                    out.answered = True
                else:
                    out.reason, out.lost = "answer without choices", True
    except asyncio.TimeoutError:
        out.reason, out.lost = "client timeout", True
    except (aiohttp.ClientError, OSError) as exc:
        out.reason, out.lost = type(exc).__name__, True
    except msgspec.DecodeError:
        out.reason, out.lost = "answer is not JSON", True
    out.ended_at = time.monotonic() - origin
    return out


async def closed_loop(
    session: aiohttp.ClientSession, url: str, mix: RequestMix, concurrency: int, seconds: float
) -> list[Outcome]:
    """``concurrency`` requests in flight for ``seconds`` (the last ones then finish)."""
    origin = time.monotonic()
    outcomes: list[Outcome] = []

    async def worker() -> None:
        while time.monotonic() - origin < seconds:
            outcomes.append(await send(session, url, mix.next(), origin))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


async def measure_capacity(
    session: aiohttp.ClientSession,
    url: str,
    mix: RequestMix,
    step_s: float,
    warm_s: float = 2.0,
    levels: Sequence[int] = RAMP_LEVELS,
) -> tuple[float, list[RampStep]]:
    """Answered requests per second at the knee of a closed-loop ramp, and the ramp.

    Each level doubles the requests in flight; the ramp stops at the first level that
    adds less than 5% over the best so far. Completions in the first ``warm_s`` of a
    level do not count.
    """
    best = 0.0
    steps: list[RampStep] = []
    for concurrency in levels:
        outcomes = await closed_loop(session, url, mix, concurrency, step_s)
        counted = [o for o in outcomes if o.answered and warm_s <= o.ended_at <= step_s]
        rate = len(counted) / (step_s - warm_s)
        step = RampStep(
            concurrency,
            rate,
            percentile([o.latency for o in counted], 99) * 1e3,
            sum(not o.answered for o in outcomes),
        )
        steps.append(step)
        print(
            f"ramp: {concurrency:>4} in flight: {rate:7.1f} answered/s, "
            f"p99 {step.p99_ms:6.0f} ms, {step.failed} failed",
            flush=True,
        )
        if rate < 1.05 * best:
            break
        best = max(best, rate)
    return best, steps
