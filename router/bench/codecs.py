"""Measure JSON libraries on the bodies the router parses and the answers it encodes.

Candidates: the stdlib ``json``, ``msgspec.json`` (what the router uses: a generic
``Decoder().decode`` for request bodies in router/serving/parsing.py, a typed Struct for the
``usage`` of an engine's answer in router/serving/forward.py, ``Encoder().encode`` for what it
writes) and ``orjson`` when it is importable (it is not a project dependency; install it
into the virtualenv to include it). Each cell is the median over repeated timeit runs
of µs per call. ``python -m router.bench.codecs`` prints the table alone;
``python -m router.bench.stack`` prints it before the HTTP candidates. It informed the
choice recorded in docs/benchmarks.md; it is not part of the product's request path.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

LIBRARIES = ("json", "msgspec", "orjson")

_WORDS = (
    "the of and to in is that for it as with was on be by this are at from or an have "
    "not which but they his her all were their one there been can more has when will "
    "would who so no if out up what about into than them could only other new some "
    "time these two may first then do any like my now over such our man me even most "
    "made after also did many before must through back years where much your way well "
    "down should because each just those people how too little state good very make "
    "world still own see men work long get here between both life being under never "
    "day same another know while last might us great old year off come since against "
    "go came right used take three café naïve über déjà-vu 東京 résumé"
).split()


def _text(rng: random.Random, words: int) -> str:
    """Prose-like text: punctuation, a line break every dozen words or so, the odd
    quoted word and non-ASCII word, so the escape paths of every codec are exercised."""
    out: list[str] = []
    for i in range(words):
        word = rng.choice(_WORDS)
        if rng.random() < 0.02:
            word = f'"{word}"'
        out.append(word)
        if rng.random() < 0.08:
            out.append(rng.choice((".", ",", ";", ":")) + ("\n" if i % 3 == 0 else ""))
    return " ".join(out).replace(" \n", "\n")


def completion_text_body(words: int = 2000, seed: int = 1) -> dict[str, Any]:
    """A /v1/completions body with one text prompt of ``words`` words."""
    rng = random.Random(seed)
    return {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "prompt": _text(rng, words),
        "max_tokens": 256,
        "temperature": 0.7,
        "stream": False,
    }


def chat_body(messages: int = 9, seed: int = 2) -> dict[str, Any]:
    """A /v1/chat/completions body: a system prompt, then alternating turns."""
    rng = random.Random(seed)
    turns = [{"role": "system", "content": _text(rng, 150)}]
    for i in range(messages - 1):
        role = "user" if i % 2 == 0 else "assistant"
        turns.append({"role": role, "content": _text(rng, rng.randint(40, 220))})
    return {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "messages": turns,
        "max_tokens": 512,
        "temperature": 0.7,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def token_ids_body(ids: int = 8192, seed: int = 3) -> dict[str, Any]:
    """A /v1/completions body whose prompt is ``ids`` token ids."""
    rng = random.Random(seed)
    return {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "prompt": [rng.randrange(128_256) for _ in range(ids)],
        "max_tokens": 128,
    }


def completion_answer(seed: int = 4) -> dict[str, Any]:
    """A non-streaming /v1/completions answer (128 words of text, with usage)."""
    rng = random.Random(seed)
    return {
        "id": "cmpl-6f1c0a2b9e4d4c8f8a7e3d2b1c0f9e8d",
        "object": "text_completion",
        "created": 1767225600,
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "choices": [
            {"index": 0, "text": _text(rng, 128), "logprobs": None, "finish_reason": "length"}
        ],
        "usage": {"prompt_tokens": 2613, "completion_tokens": 160, "total_tokens": 2773},
    }


def sse_chunk() -> dict[str, Any]:
    """One chat stream chunk (``data: {...}``), one token of delta."""
    return {
        "id": "chatcmpl-6f1c0a2b9e4d4c8f8a7e3d2b1c0f9e8d",
        "object": "chat.completion.chunk",
        "created": 1767225600,
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "choices": [
            {"index": 0, "delta": {"content": " world"}, "logprobs": None, "finish_reason": None}
        ],
    }


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None


class _WithUsage(msgspec.Struct):
    """The shape router/serving/forward.py decodes an engine's answer into."""

    usage: _Usage | None = None


@dataclass(frozen=True)
class Case:
    """One row: what is measured, on which bytes or object, and how each library does it."""

    name: str
    op: str  # "decode" or "encode"
    size: int  # bytes of JSON
    calls: dict[str, Callable[[], Any]]


def available() -> tuple[dict[str, Any], dict[str, str]]:
    """The importable libraries by name, and why each missing one is missing."""
    libs: dict[str, Any] = {"json": json, "msgspec": msgspec}
    missing: dict[str, str] = {}
    try:
        import orjson

        libs["orjson"] = orjson
    except ImportError as exc:
        missing["orjson"] = f"not importable ({exc}); `.venv/bin/pip install orjson` to include it"
    return libs, missing


def cases(libs: dict[str, Any]) -> list[Case]:
    """The rows, each checked: every library decodes to the same object, and every
    encoding decodes back to the object encoded."""
    decode_generic = msgspec.json.Decoder().decode
    decode_usage = msgspec.json.Decoder(_WithUsage).decode
    encode = msgspec.json.Encoder().encode
    out: list[Case] = []

    def decoders(raw: bytes) -> dict[str, Callable[[], Any]]:
        calls: dict[str, Callable[[], Any]] = {
            "json": lambda: json.loads(raw),
            "msgspec": lambda: decode_generic(raw),
        }
        if "orjson" in libs:
            loads = libs["orjson"].loads
            calls["orjson"] = lambda: loads(raw)
        return calls

    for name, body in (
        ("completions, 2,000-word text prompt", completion_text_body()),
        ("chat, 9 messages", chat_body()),
        ("completions, 8,192 token ids", token_ids_body()),
    ):
        raw = encode(body)
        out.append(Case(name, "decode", len(raw), decoders(raw)))

    answer = encode(completion_answer())
    usage_calls: dict[str, Callable[[], Any]] = {
        "json": lambda: json.loads(answer)["usage"]["prompt_tokens"],
        "msgspec": lambda: decode_usage(answer).usage.prompt_tokens,
    }
    if "orjson" in libs:
        loads = libs["orjson"].loads
        usage_calls["orjson"] = lambda: loads(answer)["usage"]["prompt_tokens"]
    out.append(Case("answer's usage (msgspec: typed Struct)", "decode", len(answer), usage_calls))

    for name, obj in (
        ("completion answer", completion_answer()),
        ("chat SSE chunk", sse_chunk()),
        ("chat body (P/D re-encodes it)", chat_body()),
    ):
        calls: dict[str, Callable[[], Any]] = {
            # compact separators: the same bytes the others write, not json's ", "
            "json": lambda obj=obj: json.dumps(
                obj, separators=(",", ":"), ensure_ascii=False
            ).encode(),
            "msgspec": lambda obj=obj: encode(obj),
        }
        if "orjson" in libs:
            dumps = libs["orjson"].dumps
            calls["orjson"] = lambda obj=obj, dumps=dumps: dumps(obj)
        out.append(Case(name, "encode", len(encode(obj)), calls))

    for case in out:
        results = {lib: call() for lib, call in case.calls.items()}
        if case.op == "encode":
            results = {lib: json.loads(b) for lib, b in results.items()}
        first = next(iter(results.values()))
        if any(r != first for r in results.values()):
            raise AssertionError(f"{case.name}: the libraries disagree")
    return out


def per_call_us(call: Callable[[], Any], repeat: int = 5, budget_s: float = 0.05) -> list[float]:
    """µs per call in each of ``repeat`` timeit runs of about ``budget_s`` each."""
    timer = timeit.Timer(call)
    number, elapsed = 1, timer.timeit(1)
    while elapsed < budget_s / 4 and number < 1_000_000:
        number *= 4
        elapsed = timer.timeit(number)
    number = max(1, round(number * budget_s / max(elapsed, 1e-9)))
    return [t / number * 1e6 for t in timer.repeat(repeat, number)]


def measure(
    repeat: int = 5, rounds: int = 3, budget_s: float = 0.05
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """One row per case: for every importable library, the median µs per call over
    ``rounds`` x ``repeat`` timeit runs, the libraries interleaved round by round."""
    libs, missing = available()
    rows: list[dict[str, Any]] = []
    for case in cases(libs):
        us: dict[str, list[float]] = {lib: [] for lib in case.calls}
        # Round by round, so drift on a shared machine hits every library alike.
        for _ in range(rounds):
            for lib, call in case.calls.items():
                us[lib] += per_call_us(call, repeat, budget_s)
        rows.append(
            {
                "case": case.name,
                "op": case.op,
                "bytes": case.size,
                "us": {lib: statistics.median(v) for lib, v in us.items()},
            }
        )
    return rows, missing


def format_table(rows: list[dict[str, Any]], missing: dict[str, str]) -> str:
    """A text table: µs per call per library, and each one's ratio to msgspec."""
    libs = [lib for lib in LIBRARIES if lib not in missing]
    others = [lib for lib in libs if lib != "msgspec"]
    head = (
        f"{'op':<7}{'payload':<40}{'bytes':>8}"
        + "".join(f"{lib + ' µs':>13}" for lib in libs)
        + "".join(f"{lib + '/msgspec':>16}" for lib in others)
    )
    lines = [head]
    for r in rows:
        us = r["us"]
        lines.append(
            f"{r['op']:<7}{r['case']:<40}{r['bytes']:>8,}"
            + "".join(f"{us[lib]:>13.2f}" for lib in libs)
            + "".join(f"{us[lib] / us['msgspec']:>15.2f}x" for lib in others)
        )
    for lib, why in missing.items():
        lines.append(f"skipped {lib}: {why}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5, help="timeit runs per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(format_table(*measure(args.repeat, args.rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
