"""Prompts and small helpers for the real-vLLM tier. Prompts are distinct per test (the
engines' caches are shared by the tier), long enough to fill whole 32-token blocks with
the tiny tokenizer."""

from __future__ import annotations

import random
import secrets
from collections.abc import Awaitable
from typing import Any

import aiohttp

from router.app import RouterApp
from router.fleet.registry import EngineState
from support.clients import metric_sum, metrics
from support.engines import poll
from support.routers import start_router

WORDS = (
    "the router sends each request where its prefix is cached prefill compute bound "
    "decode memory block holds thirty two tokens prompt cpu build helpful assistant "
    "answer briefly plainly system user question context document shared alpha beta "
    "gamma delta epsilon zeta eta theta"
).split()

MODEL = "tiny-llama"
#: Per test session: engines kept running between sessions (REAL_VLLM_ATTACH) hold the
#: last session's prompts in their caches.
SESSION = secrets.token_hex(3)


def text(words: int, tag: str) -> str:
    """``words`` words drawn from ``tag`` (about 2.5 tokens a word), new each session."""
    rng = random.Random(tag)
    return f"{SESSION} {tag}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def completion(prompt: str, max_tokens: int = 2, **fields: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **fields}


def cached_tokens(body: dict[str, object]) -> int:
    usage = body["usage"]
    assert isinstance(usage, dict)
    details = usage.get("prompt_tokens_details") or {}
    assert isinstance(details, dict)
    return int(details.get("cached_tokens") or 0)


async def engine_metric(http: aiohttp.ClientSession, url: str, name: str) -> float:
    """The sum of one metric's samples on an engine's (or router's) /metrics."""
    return metric_sum(await metrics(http, url), name)


async def above(value: Awaitable[float], floor: float) -> bool:
    """For ``poll``: whether an awaited number has risen past ``floor``."""
    return await value > floor


async def zero(value: Awaitable[float]) -> bool:
    """For ``poll``: whether an awaited number is 0."""
    return await value == 0


async def start_vllm_router(urls: list[Any], **sections: Any) -> RouterApp:
    """An in-process router with timers for real engines: the emulator-speed defaults of
    the other suites (0.5 s health and replay timeouts, scrapes ten times a second) eject
    or give up on a real vLLM that is busy compiling, restarting or serving on a loaded
    machine."""
    timers: dict[str, Any] = {
        "health": {"interval_s": 0.2, "timeout_s": 5.0},
        "events": {"replay_timeout_s": 5.0},
        # Fewer, more patient scrapes than the emulator suites' ten a second: a busy vLLM
        # may take over a second to answer /metrics, and answering costs it CPU.
        "scrape": {"interval_s": 0.5, "timeout_s": 5.0},
    }
    for name, value in sections.items():
        if isinstance(value, dict) and name in timers:
            timers[name] = {**timers[name], **value}
        else:
            timers[name] = value
    app = await start_router(urls, **timers)
    # ``start`` returns once every engine has been probed, but a probe that timed out on
    # a busy machine leaves its engine pending (no requests) until a later one passes: a
    # test's first request would then be the router's 503, not the engine's answer.
    try:
        await poll(lambda: not any(e.state is EngineState.PENDING for e in app.registry), 60)
    except AssertionError:
        states = {e.url: e.state.value for e in app.registry}
        await app.stop()
        raise AssertionError(f"engines still pending after 60 s: {states}") from None
    return app
