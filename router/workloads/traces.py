"""Request traces: reading, parsing and selecting what to replay.

Mooncake traces (JSONL: ``timestamp`` in ms, ``input_length``, ``output_length``,
``hash_ids``, one id per 512-token block, chained so that equal leading ids mean equal
prefixes) and the Azure LLM inference traces (CSV: ``TIMESTAMP, ContextTokens,
GeneratedTokens``; arrivals and lengths, no prefix information) parse into
:class:`TraceRequest`; a malformed line raises :class:`TraceError` naming it. The
public traces ship in ``bundled_traces/`` beside this module (:data:`BUNDLED_TRACES`).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any

#: Tokens per hash id in the Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512

#: Workload names that refer to the traces shipped in ``router/workloads/bundled_traces``.
BUNDLED_TRACES = {
    "mooncake-conversation": "conversation_trace.jsonl.gz",
    "mooncake-synthetic": "synthetic_trace.jsonl.gz",
    "azure-code": "AzureLLMInferenceTrace_code.csv.gz",
    "azure-conv": "AzureLLMInferenceTrace_conv.csv.gz",
}


class TraceError(ValueError):
    """A trace line that cannot be replayed; the message names the source and line."""

    def __init__(self, source: str, line: int, reason: str) -> None:
        super().__init__(f"{source}, line {line}: {reason}")
        self.source = source
        self.line = line
        self.reason = reason


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    at: float
    """Seconds after the trace's first request."""
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    """One id per block of the prompt; equal leading ids mean equal prefixes."""


@dataclass(frozen=True, slots=True)
class Trace:
    """A parsed trace and how to read its hash ids."""

    name: str
    requests: tuple[TraceRequest, ...]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    has_prefixes: bool = True
    """False when the source carries no prefix information (each prompt is unique)."""


class _FreshIds:
    """Negative block ids, unique within one parse, for prompts without ``hash_ids``."""

    def __init__(self) -> None:
        self.next = -1

    def take(self, count: int) -> tuple[int, ...]:
        ids = tuple(range(self.next, self.next - count, -1))
        self.next -= count
        return ids


def _int_field(obj: dict[str, Any], name: str, minimum: int, source: str, line: int) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(source, line, f"{name!r} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(source, line, f"{name!r} must be >= {minimum}, got {value}")
    return value


def parse_mooncake(
    lines: Iterable[str], source: str = "trace", block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> list[TraceRequest]:
    """Parse Mooncake JSONL lines, sorted by arrival (stable); blank lines are skipped.

    ``hash_ids`` must hold ``ceil(input_length / block_tokens)`` ids; without it (AIPerf
    allows that) the prompt is unique and gets fresh negative ids.
    """
    fresh = _FreshIds()
    out: list[TraceRequest] = []
    for number, raw in enumerate(lines, 1):
        text = raw.strip()
        if not text:
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(source, number, f"not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(source, number, "expected a JSON object")
        stamp = obj.get("timestamp", 0)
        if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not stamp >= 0:
            raise TraceError(source, number, f"'timestamp' must be a number >= 0, got {stamp!r}")
        length = _int_field(obj, "input_length", 1, source, number)
        output = _int_field(obj, "output_length", 0, source, number)
        blocks = math.ceil(length / block_tokens)
        ids = obj.get("hash_ids")
        if ids is None:
            hash_ids = fresh.take(blocks)
        else:
            if not isinstance(ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in ids
            ):
                raise TraceError(source, number, "'hash_ids' must be a list of integers")
            if len(ids) != blocks:
                raise TraceError(
                    source,
                    number,
                    f"{len(ids)} hash_ids for input_length {length}: expected {blocks} "
                    f"(one per {block_tokens}-token block)",
                )
            hash_ids = tuple(ids)
        out.append(TraceRequest(stamp / 1000.0, length, output, hash_ids))
    return _from_zero(out)


def _azure_time(text: str) -> float:
    """Seconds since the epoch of ``2023-11-16 18:17:03.9799600`` (7 fraction digits)."""
    whole, _, fraction = text.strip().partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float(f"0.{fraction}") if fraction else 0.0)


def parse_azure(
    lines: Iterable[str], source: str = "trace", block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> list[TraceRequest]:
    """Parse an Azure LLM inference trace (CSV with a header), sorted by arrival.

    The traces hold no prefix information, so every prompt is unique (fresh ids).
    """
    reader = csv.reader(lines)
    header = next(reader, None)
    wanted = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    if header is None or any(name not in header for name in wanted):
        raise TraceError(source, 1, f"expected a header with {', '.join(wanted)}")
    cols = [header.index(name) for name in wanted]
    fresh = _FreshIds()
    out: list[TraceRequest] = []
    for row in reader:
        if not row:
            continue
        number = reader.line_num
        try:
            stamp = _azure_time(row[cols[0]])
            length = int(row[cols[1]])
            output = int(row[cols[2]])
        except (IndexError, ValueError) as exc:
            raise TraceError(source, number, f"bad row {row!r} ({exc})") from None
        if length < 1 or output < 0:
            raise TraceError(source, number, f"lengths out of range in {row!r}")
        ids = fresh.take(math.ceil(length / block_tokens))
        out.append(TraceRequest(stamp, length, output, ids))
    return _from_zero(out)


def _from_zero(requests: list[TraceRequest]) -> list[TraceRequest]:
    requests.sort(key=lambda r: r.at)
    if not requests:
        return requests
    first = requests[0].at
    return [replace(r, at=r.at - first) for r in requests]


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def read_trace(source: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Trace:
    """Read a bundled trace by name (:data:`BUNDLED_TRACES`) or a trace file by path.

    ``.csv`` (optionally ``.gz``) files are Azure traces; anything else is Mooncake JSONL.
    """
    name = str(source)
    if name in BUNDLED_TRACES:
        ref = resources.files("router.workloads") / "bundled_traces" / BUNDLED_TRACES[name]
        with resources.as_file(ref) as path:
            return _read_path(path, name, block_tokens)
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(
            f"no trace {name!r}: not a file, and not one of {', '.join(BUNDLED_TRACES)}"
        )
    return _read_path(path, path.name, block_tokens)


def _read_path(path: Path, name: str, block_tokens: int) -> Trace:
    azure = path.name.removesuffix(".gz").endswith(".csv")
    with _open_text(path) as f:
        if azure:
            return Trace(name, tuple(parse_azure(f, name, block_tokens)), block_tokens, False)
        return Trace(name, tuple(parse_mooncake(f, name, block_tokens)), block_tokens, True)


def select(
    requests: Sequence[TraceRequest],
    *,
    limit: int | None = None,
    duration: float | None = None,
    speedup: float = 1.0,
) -> list[TraceRequest]:
    """The requests to replay: arrivals compressed by ``speedup``, only those arriving
    within ``duration`` replay seconds, at most the first ``limit``."""
    if speedup <= 0:
        raise ValueError("speedup must be positive")
    out: list[TraceRequest] = []
    for r in requests:
        at = r.at / speedup
        if duration is not None and at > duration:
            break
        if limit is not None and len(out) >= limit:
            break
        out.append(replace(r, at=at))
    return out
