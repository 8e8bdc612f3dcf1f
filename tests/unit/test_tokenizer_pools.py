"""``tokenizer.mode: auto`` settles by probing an engine's /tokenize; a probe that fails
(a busy engine's timeout or 5xx) is tried again by a later request, after a wait that
doubles, instead of leaving the pool approximate for the router's lifetime. The engine
is a function here: what is under test is when the pool probes, not HTTP."""

from __future__ import annotations

import asyncio

import msgspec

from router.config import load_config
from router.tokenization.pools import FIRST_RETRY_S, PROBE, Tokenizers
from router.tokenization.words import WordTokenizer

MODEL = "m"


class Engine:
    """Answers /tokenize as the emulator does, after failing as told."""

    def __init__(self, failures: list[object]) -> None:
        self.failures = failures
        self.calls = 0

    async def post(self, model: str, path: str, body: bytes) -> tuple[int, bytes]:
        self.calls += 1
        assert path == "/tokenize" and msgspec.json.decode(body)["prompt"] == PROBE
        if self.failures:
            failure = self.failures.pop(0)
            if isinstance(failure, Exception):
                raise failure
            return int(str(failure)), b"{}"
        tokens = WordTokenizer(decodes=False).encode(PROBE)
        return 200, msgspec.json.encode({"tokens": tokens})


async def test_a_failed_probe_is_tried_again_by_a_later_request() -> None:
    now = [0.0]
    engine = Engine([TimeoutError("no answer in 2 s"), 503])
    pools = Tokenizers(load_config(environ={}), engine.post, clock=lambda: now[0])
    assert await pools.resolve(MODEL) == "approximate"
    assert engine.calls == 1
    # Within the wait, requests use the safe mode and do not probe.
    assert pools.for_model(MODEL).mode == "approximate"
    await asyncio.sleep(0)
    assert engine.calls == 1
    # After it, the next request probes in the background: a 503 is no answer either,
    # and the wait doubles.
    now[0] = FIRST_RETRY_S
    assert pools.for_model(MODEL).mode == "approximate"
    await asyncio.sleep(0)
    assert engine.calls == 2
    now[0] = FIRST_RETRY_S + FIRST_RETRY_S * 2 - 0.1
    pools.for_model(MODEL)
    await asyncio.sleep(0)
    assert engine.calls == 2
    now[0] += 0.1
    pools.for_model(MODEL)
    await asyncio.sleep(0)
    assert engine.calls == 3
    # That probe was answered: the pool is the emulator's words, for good.
    assert await pools.resolve(MODEL) == "words"
    now[0] += 1000
    pools.for_model(MODEL)
    await asyncio.sleep(0)
    assert engine.calls == 3


async def test_an_engine_without_tokenize_settles_approximate_at_once() -> None:
    engine = Engine([404])
    pools = Tokenizers(load_config(environ={}), engine.post, clock=lambda: 1e9)
    assert await pools.resolve(MODEL) == "approximate"
    pools.for_model(MODEL)
    await asyncio.sleep(0)
    assert engine.calls == 1  # an answer, not a failure: never asked again
