"""``make soak``: the router under steady load for a bounded time, with faults on a schedule.

``python -m router.bench.soak`` starts on loopback, each in its own process group: a
throw-away ``redis-server`` on a free port (never the machine's own Redis), four
emulated engines (``kvroute engine``) publishing KV events, and ``kvroute serve`` in
front of them with the Redis index. Then it

1. measures capacity: a short closed-loop ramp through the router (2, 4, 8, ...
   requests in flight) until answered requests per second stop growing;
2. sends an open-loop paced stream at ``--load`` (80%) of that capacity for
   ``--minutes`` (10): streaming and non-streaming completions and chat completions,
   over system prompts that many requests share;
3. injects faults on a schedule (:func:`fault_plan`): an engine SIGKILLed and started
   again on the same port, the Redis server SIGKILLed and started again empty, and an
   engine that stalls mid-stream (``stall_after_tokens`` through its ``/admin/faults``)
   for a while;
4. prints per minute (by the minute a request was sent): requests sent, answered,
   failed by reason, lost, latency p50/p99 of the answered ones, the router's resident
   memory (``VmRSS`` at the minute's end) and CPU, the CPU of the soak's processes and
   of the whole machine, and the router's Redis outages; then the router's counters
   and a summary of its log, and a verdict:

   * no request lost: each got an answer or a clean error (an HTTP status with an
     OpenAI error body, or an SSE error event followed by ``[DONE]``);
   * no failure the router caused: every failure was served by an engine while it was
     being restarted or stalled (:func:`attribute`); a Redis restart excuses none, and
     a 500 or a ``router_error`` is never excused;
   * memory flat: the router's RSS at the end of the last minute is within 10% of its
     RSS at the end of minute 2 (minute 1 is warm-up).

Everything goes to ``--output`` (``bench-results/soak.json``); the exit status is 1 when
the verdict fails. docs/reliability.md quotes a full run. The report maths
(:func:`attribute`, :func:`minute_rows`, :func:`judge`, the formatting) is pure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from router.bench.loadgen import percentile, sse_data
from router.bench.overhead import cpu_seconds
from router.bench.targets import HOST, _get, _replays_ok, _wait, free_port
from router.bench.throwaway_redis import RedisServer
from router.bench.workloads import RequestSpec, words
from router.engines.registry import endpoint_of
from router.process import EngineProcess, ServerProcess

T = TypeVar("T")

ENGINES = 4
#: Emulated-engine settings besides ``--max-num-seqs`` and ``--time-scale`` (flags of the
#: soak): a small cache keeps blocks being evicted, so the index never stops changing.
ENGINE_ARGS = ("--cache-blocks", "2048")
#: Router counters the report quotes from its /metrics at the end (summed per label set).
ROUTER_COUNTERS = (
    "kvroute_requests_total",
    "kvroute_retries_total",
    "kvroute_engine_ejections_total",
    "kvroute_index_outages_total",
    "kvroute_index_fallbacks_total",
    "kvroute_index_unwritten_records_total",
    "kvroute_index_replayed_records_total",
    "kvroute_kv_event_resnapshots_total",
    "kvroute_kv_event_restarts_total",
    "kvroute_kv_event_gaps_total",
)
#: Router settings besides the Redis index: deadlines short enough that a stalled engine
#: shows within seconds (the defaults, 120 s to the first byte and 60 s of silence, are
#: for real prefills), and JSON logs the report can count.
ROUTER_CONFIG: dict[str, Any] = {
    "proxy": {"first_byte_timeout_s": 20.0, "idle_timeout_s": 5.0},
    "server": {"log_level": "warning", "log_format": "json"},
}
#: The router's ``index.budget_ms`` in the soak. With its default, 5 ms, on two cores that
#: run everything, lookups Redis answers in 0.1 ms often take longer than 5 ms to reach
#: the router's handler: every such call marks the index down, and about half the
#: decisions of a soak are made without it (docs/reliability.md shows such a run).
REDIS_BUDGET_MS = 50.0
RAMP_LEVELS = (2, 4, 8, 16, 32, 64, 128)
#: Seconds after a fault ends during which its engine's failures are still its own
#: (a request stalled just before the fault was cleared fails an idle timeout later).
GRACE_S = 10.0
WARMUP_MINUTE = 2
RSS_TOLERANCE = 0.10


# ------------------------------------------------------------------------------ records


@dataclass(slots=True)
class Outcome:
    """What one request did, as the client saw it (times in seconds from the run's start)."""

    sent_at: float
    kind: str
    """``completion`` or ``chat``, with ``-stream`` when streamed."""
    ended_at: float = 0.0
    status: int = 0
    engine: str = ""
    """The router's ``x-kvroute-engine`` header (``host:port``), empty when absent."""
    answered: bool = False
    reason: str = ""
    """Empty when answered; else ``http-STATUS`` or ``sse-CODE`` (a clean error, with
    the error's own code when it is a word), or why it was lost."""
    lost: bool = False

    @property
    def latency(self) -> float:
        return self.ended_at - self.sent_at


@dataclass(frozen=True, slots=True)
class FaultWindow:
    """One injected fault as it happened."""

    name: str
    start: float
    end: float
    engine: str | None = None
    """The faulted engine (``host:port``); None for Redis."""


@dataclass(frozen=True, slots=True)
class Sample:
    """The router process and the machine at one moment (CPU figures cumulative)."""

    t: float
    rss_kib: int
    router_cpu_s: float
    soak_cpu_s: float = 0.0
    """Every process of the soak: router, engines, Redis and the load generator."""
    client_cpu_s: float = 0.0
    """The load generator (this process)."""
    host_busy_s: float = 0.0
    """The whole machine, every process of every user (all but idle and iowait)."""
    index_outages: float = 0.0
    """The router's ``kvroute_index_outages_total``: Redis unreachable or over budget."""


@dataclass(slots=True)
class MinuteRow:
    """One minute of the soak, by the minute requests were sent."""

    minute: int
    faults: list[str]
    sent: int
    answered: int
    failed: int
    """Clean errors (lost requests are not counted here)."""
    lost: int
    reasons: dict[str, int]
    p50_ms: float
    p99_ms: float
    rss_mib: float
    """The router's RSS at the end of the minute (its last sample)."""
    router_cpu: float
    """Percent of one core."""
    soak_cpu: float
    """Percent of the machine (all cores) used by the soak's processes."""
    host_cpu: float
    """Percent of the machine used by everything on it."""
    index_outages: int = 0
    """Times the router found Redis unreachable or over budget in the minute."""


@dataclass(slots=True)
class Verdict:
    """The soak's three claims and the numbers behind them."""

    requests: int
    lost: int
    failed: int
    attributed: dict[str, int]
    unexplained: list[Outcome]
    rss_from: tuple[int, float]
    rss_to: tuple[int, float]
    tolerance: float = RSS_TOLERANCE

    @property
    def rss_growth(self) -> float:
        return self.rss_to[1] / self.rss_from[1] - 1 if self.rss_from[1] else math.inf

    @property
    def no_loss(self) -> bool:
        return self.lost == 0

    @property
    def no_router_failure(self) -> bool:
        return not self.unexplained

    @property
    def memory_flat(self) -> bool:
        return abs(self.rss_growth) <= self.tolerance

    @property
    def passed(self) -> bool:
        return self.no_loss and self.no_router_failure and self.memory_flat


# ------------------------------------------------------------------------------ report maths


def fault_plan(duration: float) -> list[tuple[str, float, float]]:
    """(fault, start, how long) for a soak of ``duration`` seconds.

    At 25%, 45% and 65% of the run (2:30, 4:30, 6:30 in ten minutes), so each fault has
    clean minutes before it and the last minutes show the recovery. Down times are
    5 s; the stall lasts 5% of the run, at least 10 s and at most 30 s.
    """
    stall = min(30.0, max(10.0, 0.05 * duration))
    return [
        ("engine restart", 0.25 * duration, 5.0),
        ("redis restart", 0.45 * duration, 5.0),
        ("engine stall", 0.65 * duration, stall),
    ]


def attribute(outcome: Outcome, windows: Sequence[FaultWindow], grace: float = GRACE_S) -> str:
    """The injected fault a failed request is owed to, or ``""`` if none explains it.

    A failure is the fault's when the request was in flight between the fault's start
    and ``grace`` seconds after its end, and the router named the faulted engine (or no
    engine at all). Redis faults explain nothing: the router must route around them.
    A 500 or a ``router_error`` is the router's, whatever else happened.
    """
    if outcome.status == 500 or "router_error" in outcome.reason:
        return ""
    for window in windows:
        if window.engine is None or outcome.engine not in ("", window.engine):
            continue
        if outcome.sent_at <= window.end + grace and outcome.ended_at >= window.start:
            return window.name
    return ""


def minute_rows(
    outcomes: Sequence[Outcome],
    samples: Sequence[Sample],
    windows: Sequence[FaultWindow],
    duration: float,
    cores: int = 1,
) -> list[MinuteRow]:
    """The per-minute table: requests by the minute they were sent, samples by time
    (CPU over the minute from the sample before it to its last one)."""
    rows = []
    for minute in range(1, max(1, math.ceil(duration / 60 - 1e-9)) + 1):
        lo, hi = (minute - 1) * 60.0, minute * 60.0
        sent = [o for o in outcomes if lo <= o.sent_at < hi]
        ok = [o.latency for o in sent if o.answered]
        failed = [o for o in sent if not o.answered and not o.lost]
        lost = [o for o in sent if o.lost]
        reasons = Counter(o.reason for o in failed) + Counter("lost" for _ in lost)
        inside = [s for s in samples if lo <= s.t <= hi]
        before = [s for s in samples if s.t <= lo]
        span = ([before[-1]] if before else []) + inside
        first, last = (span[0], span[-1]) if span else (None, None)
        router_cpu = soak_cpu = host_cpu = 0.0
        outages = 0
        if first is not None and last is not None and last.t > first.t:
            outages = int(last.index_outages - first.index_outages)
            elapsed = last.t - first.t
            router_cpu = 100 * (last.router_cpu_s - first.router_cpu_s) / elapsed
            soak_cpu = 100 * (last.soak_cpu_s - first.soak_cpu_s) / elapsed / cores
            host_cpu = 100 * (last.host_busy_s - first.host_busy_s) / elapsed / cores
        rows.append(
            MinuteRow(
                minute=minute,
                faults=[w.name for w in windows if w.start < hi and w.end > lo],
                sent=len(sent),
                answered=len(ok),
                failed=len(failed),
                lost=len(lost),
                reasons=dict(sorted(reasons.items())),
                p50_ms=percentile(ok, 50) * 1e3,
                p99_ms=percentile(ok, 99) * 1e3,
                rss_mib=last.rss_kib / 1024 if last is not None else float("nan"),
                router_cpu=router_cpu,
                soak_cpu=soak_cpu,
                host_cpu=host_cpu,
                index_outages=outages,
            )
        )
    return rows


def judge(
    outcomes: Sequence[Outcome],
    rows: Sequence[MinuteRow],
    windows: Sequence[FaultWindow],
    warmup_minute: int = WARMUP_MINUTE,
    tolerance: float = RSS_TOLERANCE,
    grace: float = GRACE_S,
) -> Verdict:
    """The verdict: lost requests, failures no fault explains, RSS after warm-up vs last.

    Memory compares the end of ``warmup_minute`` with the end of the last minute; a run
    too short for that compares its first minute with its last.
    """
    failures = [o for o in outcomes if not o.answered and not o.lost]
    attributed: Counter[str] = Counter()
    unexplained = []
    for outcome in failures:
        fault = attribute(outcome, windows, grace)
        if fault:
            attributed[fault] += 1
        else:
            unexplained.append(outcome)
    start = rows[warmup_minute - 1] if len(rows) > warmup_minute else rows[0]
    return Verdict(
        requests=len(outcomes),
        lost=sum(o.lost for o in outcomes),
        failed=len(failures),
        attributed=dict(attributed),
        unexplained=unexplained,
        rss_from=(start.minute, start.rss_mib),
        rss_to=(rows[-1].minute, rows[-1].rss_mib),
        tolerance=tolerance,
    )


def _reasons_cell(reasons: dict[str, int]) -> str:
    return ", ".join(f"{reason}: {count}" for reason, count in reasons.items()) or "-"


def format_table(rows: Sequence[MinuteRow]) -> str:
    """The per-minute table in Markdown, as docs/reliability.md quotes it."""
    header = (
        "| min | faults | sent | answered | failed (by reason) | lost | p50 ms | p99 ms "
        "| router RSS MiB | router CPU % | soak CPU % | host CPU % | index outages |"
    )
    lines = [header, "|" + "|".join(["---"] * (header.count("|") - 1)) + "|"]
    for r in rows:
        failed = f"{r.failed}" + (f" ({_reasons_cell(r.reasons)})" if r.failed else "")
        lines.append(
            f"| {r.minute} | {', '.join(r.faults) or '-'} | {r.sent} | {r.answered} | {failed} "
            f"| {r.lost} | {r.p50_ms:.0f} | {r.p99_ms:.0f} | {r.rss_mib:.1f} "
            f"| {r.router_cpu:.0f} | {r.soak_cpu:.0f} | {r.host_cpu:.0f} | {r.index_outages} |"
        )
    return "\n".join(lines)


def format_verdict(verdict: Verdict) -> list[str]:
    """The verdict's lines, each claim with PASS or FAIL and its numbers."""

    def mark(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    owed = ", ".join(f"{name}: {n}" for name, n in sorted(verdict.attributed.items()))
    lines = [
        f"{mark(verdict.no_loss)} requests lost: {verdict.lost} of {verdict.requests} "
        f"(every other request got an answer or a clean, counted error)",
        f"{mark(verdict.no_router_failure)} failures the router caused: "
        f"{len(verdict.unexplained)} ({verdict.failed} failed, "
        f"{verdict.failed - len(verdict.unexplained)} of them during injected faults"
        + (f": {owed})" if owed else ")"),
        f"{mark(verdict.memory_flat)} router memory: {verdict.rss_from[1]:.1f} MiB at the end "
        f"of minute {verdict.rss_from[0]}, {verdict.rss_to[1]:.1f} MiB at the end of minute "
        f"{verdict.rss_to[0]}: {verdict.rss_growth:+.1%} (limit ±{verdict.tolerance:.0%})",
    ]
    for o in verdict.unexplained[:10]:
        lines.append(
            f"  unexplained: sent {o.sent_at:.1f} s, ended {o.ended_at:.1f} s, {o.kind}, "
            f"engine {o.engine or '-'}, {o.reason}"
        )
    lines.append(f"verdict: {mark(verdict.passed)}")
    return lines


def router_counters(text: str, names: Sequence[str] = ROUTER_COUNTERS) -> dict[str, float]:
    """``name{labels}`` -> value for the samples of ``names`` in Prometheus text, with
    the ``engine`` label dropped (and those samples summed); zero samples left out."""
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in names or not sample.value:
                continue
            labels = ",".join(
                f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "engine"
            )
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] += sample.value
    return dict(sorted(out.items()))


def summarize_logs(text: str, limit: int = 12) -> tuple[list[tuple[str, str, int]], list[str]]:
    """The router's JSON log lines as (level, message with numbers elided, count), most
    frequent first, and the distinct tracebacks logged with them."""
    seen: Counter[tuple[str, str]] = Counter()
    tracebacks: dict[str, None] = {}
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            seen[("raw", re.sub(r"\d+", "N", line.strip())[:160])] += 1
            continue
        if isinstance(entry, dict):
            msg = re.sub(r"\d+", "N", str(entry.get("msg", "")))[:160]
            seen[(str(entry.get("level", "?")), msg)] += 1
            if entry.get("exc"):
                tracebacks[str(entry["exc"])] = None
    return [(level, msg, n) for (level, msg), n in seen.most_common(limit)], list(tracebacks)


# ------------------------------------------------------------------------------ requests


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
        if stream:
            extra["stream_options"] = {"include_usage": True}
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


async def _read_stream(resp: aiohttp.ClientResponse, out: Outcome) -> None:
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
    body: dict[str, Any] = {"max_tokens": spec.max_tokens, **spec.extra}
    if chat:
        body["messages"] = spec.messages
    else:
        body["prompt"] = spec.prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
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
                await _read_stream(resp, out)
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


@dataclass(slots=True)
class RampStep:
    """One level of the capacity ramp."""

    concurrency: int
    answered_per_s: float
    p99_ms: float
    failed: int


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


# ------------------------------------------------------------------------------ processes


def read_rss_kib(pid: int) -> int:
    """``VmRSS`` of a process, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


def host_busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (all but idle and iowait), all cores."""
    with open("/proc/stat") as f:
        values = [float(v) for v in f.readline().split()[1:8]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


class Fleet:
    """Redis, the engines and the router of one soak, each in its own process group.

    Engines keep their HTTP, replay and event addresses across restarts, so the router
    finds a restarted engine where it was. :meth:`close` stops whatever is running.
    """

    def __init__(
        self,
        engines: int,
        engine_args: Sequence[str],
        start_timeout: float,
        index_options: dict[str, Any] | None = None,
    ) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="kvroute-soak-")
        self.workdir = Path(self._tmp.name)
        self.engine_args = list(engine_args)
        self.start_timeout = start_timeout
        self.redis: RedisServer | None = None
        self.redis_port = 0
        self.ports = [free_port() for _ in range(engines)]
        self.replay_ports = [free_port() for _ in range(engines)]
        self.engines: list[EngineProcess | None] = [None] * engines
        self.router: ServerProcess | None = None
        self.namespace = f"kvroute-soak-{uuid.uuid4().hex[:8]}"
        self.index_options = dict(index_options or {})

    @property
    def engine_urls(self) -> list[str]:
        return [f"http://{HOST}:{port}" for port in self.ports]

    @property
    def router_url(self) -> str:
        assert self.router is not None
        return self.router.url

    @property
    def router_pid(self) -> int:
        assert self.router is not None
        return self.router.proc.pid

    def pids(self) -> list[int]:
        """Every process of the soak running now (this one included)."""
        procs = [e.proc for e in self.engines if e is not None]
        procs += [p.proc for p in (self.router, self.redis) if p is not None]
        return [os.getpid(), *(p.pid for p in procs if p.poll() is None)]

    def router_config(self) -> dict[str, Any]:
        assert self.redis is not None
        index = {"backend": "redis", "url": self.redis.url, "namespace": self.namespace}
        return {"index": {**index, **self.index_options}, **ROUTER_CONFIG}

    def start(self) -> None:
        self.redis = RedisServer()
        self.redis_port = self.redis.port
        for i in range(len(self.engines)):
            self.start_engine(i)
        config = self.workdir / "router.yaml"
        config.write_text(json.dumps(self.router_config(), indent=2))  # JSON is YAML
        args = ["--port", "0", "--config", str(config)]
        for url in self.engine_urls:
            args += ["--engine", url]
        self.router = ServerProcess("serve", args, timeout=self.start_timeout)
        url = self.router.url
        _wait(f"kvroute serve at {url} was not ready", lambda: _get(f"{url}/ready")[0] == 200, 60)
        _wait(
            f"kvroute serve did not follow the KV events of {len(self.engines)} engines",
            lambda: _replays_ok(_get(f"{url}/metrics")[1]) >= len(self.engines),
            60,
        )

    def start_engine(self, i: int) -> None:
        self.engines[i] = EngineProcess(
            [
                "--port", str(self.ports[i]),
                "--engine-id", f"soak-{i}",
                "--kv-events-endpoint", f"ipc://{self.workdir}/engine{i}-events",
                "--kv-events-replay-endpoint", f"tcp://{HOST}:{self.replay_ports[i]}",
                "--log-level", "warning",
                *self.engine_args,
            ],
            timeout=self.start_timeout,
        )  # fmt: skip

    def kill_engine(self, i: int) -> None:
        """SIGKILL engine ``i``'s process group (no drain, like a crashed pod)."""
        engine = self.engines[i]
        self.engines[i] = None
        if engine is not None:
            try:
                os.killpg(engine.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            engine.proc.wait(timeout=10)
            engine.stop()

    def kill_redis(self) -> None:
        if self.redis is not None:
            self.redis.kill()
            self.redis = None

    def start_redis(self) -> None:
        """A new, empty ``redis-server`` on the port the router knows."""
        self.redis = RedisServer(port=self.redis_port)

    def router_metrics(self) -> str:
        """The router's /metrics text (empty if it does not answer)."""
        return _get(f"{self.router_url}/metrics", timeout=10)[1]

    def router_log(self) -> str:
        """What the router wrote to stderr so far."""
        assert self.router is not None
        self.router.stderr.flush()
        self.router.stderr.seek(0)
        return self.router.stderr.read()

    def close(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None
        for i in range(len(self.engines)):
            engine = self.engines[i]
            if engine is not None:
                engine.stop()
                self.engines[i] = None
        self.kill_redis()
        self._tmp.cleanup()


# ------------------------------------------------------------------------------ the soak


@dataclass(slots=True)
class SoakRun:
    """Everything one soak recorded."""

    capacity: float
    rate: float
    ramp: list[RampStep]
    duration: float
    outcomes: list[Outcome] = field(default_factory=list)
    windows: list[FaultWindow] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    unfinished: int = 0
    pacer_lag_max_s: float = 0.0


async def _inject(
    fleet: Fleet,
    session: aiohttp.ClientSession,
    origin: float,
    duration: float,
    windows: list[FaultWindow],
) -> None:
    """Run :func:`fault_plan`, recording each fault's real start and end."""

    def now() -> float:
        return time.monotonic() - origin

    restart, stall = 1, 2  # which engines (0-based) suffer
    for name, at, hold in fault_plan(duration):
        await asyncio.sleep(max(0.0, at - now()))
        start = now()
        if name == "engine restart":
            await asyncio.to_thread(fleet.kill_engine, restart)
            await asyncio.sleep(hold)
            await asyncio.to_thread(fleet.start_engine, restart)
            engine = endpoint_of(fleet.engine_urls[restart])
        elif name == "redis restart":
            await asyncio.to_thread(fleet.kill_redis)
            await asyncio.sleep(hold)
            await asyncio.to_thread(fleet.start_redis)
            engine = None
        else:
            url = f"{fleet.engine_urls[stall]}/admin/faults"
            async with session.post(url, json={"stall_after_tokens": 4}) as resp:
                resp.raise_for_status()
            await asyncio.sleep(hold)
            async with session.delete(url) as resp:
                resp.raise_for_status()
            engine = endpoint_of(fleet.engine_urls[stall])
        windows.append(FaultWindow(name, start, now(), engine))
        print(f"fault: {name} from {start:.1f} s to {now():.1f} s", flush=True)


async def _sample(
    fleet: Fleet,
    session: aiohttp.ClientSession,
    origin: float,
    every: float,
    out: list[Sample],
) -> None:
    router, me = fleet.router_pid, os.getpid()
    seen: dict[int, float] = {}  # CPU seconds per process at its last sample
    soak = outages = 0.0
    while True:
        try:
            async with session.get(f"{fleet.router_url}/metrics") as resp:
                text = await resp.text()
            outages = router_counters(text, ["kvroute_index_outages_total"]).get(
                "kvroute_index_outages_total", 0.0
            )
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            pass  # keep the last value
        for pid in fleet.pids():
            try:
                now = cpu_seconds(pid)
            except (OSError, IndexError):  # it ended meanwhile
                continue
            soak += now - seen.get(pid, 0.0)
            seen[pid] = now
        try:
            rss = read_rss_kib(router)
        except OSError:  # the router is gone: the requests' outcomes tell the rest
            return
        t = time.monotonic() - origin
        cpu = seen.get(router, 0.0)
        out.append(Sample(t, rss, cpu, soak, seen[me], host_busy_seconds(), outages))
        await asyncio.sleep(every)


async def _progress(run: SoakRun, origin: float, inflight: Callable[[], int]) -> None:
    minute = 0
    while True:
        minute += 1
        await asyncio.sleep(max(0.0, minute * 60 - (time.monotonic() - origin)))
        done = len(run.outcomes)
        failed = sum(not o.answered for o in run.outcomes)
        rss = run.samples[-1].rss_kib / 1024 if run.samples else float("nan")
        print(
            f"soak: minute {minute} done: {done} answered or failed ({failed} failed), "
            f"{inflight()} in flight, router RSS {rss:.1f} MiB",
            flush=True,
        )


async def soak(fleet: Fleet, args: argparse.Namespace) -> SoakRun:
    """Measure capacity, then the open-loop soak with faults; see the module docstring."""
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        mix = RequestMix(args.seed)
        url = fleet.router_url
        if args.rate:
            capacity, ramp = args.rate / args.load, []
        else:
            capacity, ramp = await measure_capacity(session, url, mix, args.ramp_step_s)
        if capacity <= 0:
            raise RuntimeError("the capacity ramp answered no request")
        rate = args.load * capacity
        duration = args.minutes * 60.0
        total = int(rate * duration)
        print(
            f"soak: capacity {capacity:.1f} answered/s; sending {rate:.1f} requests/s "
            f"({args.load:.0%}) open loop for {duration:.0f} s ({total} requests)",
            flush=True,
        )
        run = SoakRun(capacity, rate, ramp, duration)
        origin = time.monotonic()
        pending: dict[asyncio.Task[Outcome], float] = {}

        def finished(task: asyncio.Task[Outcome]) -> None:
            at = pending.pop(task)
            if task.cancelled():
                # Still unanswered when the drain ended: lost, whatever comes later.
                run.outcomes.append(Outcome(at, "unfinished", reason="no answer", lost=True))
            elif task.exception() is not None:
                reason = f"load generator error: {task.exception()!r}"
                run.outcomes.append(Outcome(at, "unknown", reason=reason, lost=True))
            else:
                run.outcomes.append(task.result())

        helpers = [
            asyncio.ensure_future(_sample(fleet, session, origin, 2.0, run.samples)),
            asyncio.ensure_future(_progress(run, origin, lambda: len(pending))),
        ]
        injector = asyncio.ensure_future(_inject(fleet, session, origin, duration, run.windows))
        try:
            for i in range(total):
                lag = time.monotonic() - origin - i / rate
                if lag < 0:
                    await asyncio.sleep(-lag)
                else:
                    run.pacer_lag_max_s = max(run.pacer_lag_max_s, lag)
                task = asyncio.ensure_future(send(session, url, mix.next(), origin))
                pending[task] = time.monotonic() - origin
                task.add_done_callback(finished)
            await injector
            if pending:
                await asyncio.wait(set(pending), timeout=args.request_timeout + 10)
            run.unfinished = len(pending)
            await asyncio.sleep(2.0)  # one more sample after the last answer
        finally:
            for task in [*helpers, injector, *pending]:
                task.cancel()
            await asyncio.gather(*helpers, injector, *pending, return_exceptions=True)
    return run


def _run_async(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finalizers that stop the fleet


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Soak the router: open-loop load at a share of measured capacity, "
        "with an engine restart, a Redis restart and a stalled engine on a schedule."
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="soak length (default 10)")
    parser.add_argument(
        "--load", type=float, default=0.8, help="share of measured capacity (default 0.8)"
    )
    parser.add_argument(
        "--rate", type=float, default=0.0, help="requests/s to send, skipping the capacity ramp"
    )
    parser.add_argument("--ramp-step-s", type=float, default=8.0, help="seconds per ramp level")
    parser.add_argument(
        "--max-num-seqs", type=int, default=8, help="each engine's batch size (default 8)"
    )
    parser.add_argument(
        "--time-scale", type=float, default=2.0, help="engines' wall seconds per model second"
    )
    parser.add_argument(
        "--redis-budget-ms",
        type=float,
        default=REDIS_BUDGET_MS,
        help=f"the router's index.budget_ms (default {REDIS_BUDGET_MS:.0f}; 0: the router's "
        "own default)",
    )
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="bench-results/soak.json")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or not 0 < args.load <= 1.5:
        parser.error("--minutes must be positive and --load in (0, 1.5]")
    signal.signal(signal.SIGTERM, _terminate)
    # A small batch and a slowed clock make the engines the bottleneck, not the two CPU
    # cores that run everything, the load generator included.
    engine_args = [
        "--max-num-seqs", str(args.max_num_seqs), "--time-scale", str(args.time_scale),
        *ENGINE_ARGS,
    ]  # fmt: skip
    index_options = {"budget_ms": args.redis_budget_ms} if args.redis_budget_ms else {}
    fleet = Fleet(ENGINES, engine_args, start_timeout=60.0, index_options=index_options)
    try:
        fleet.start()
        print(
            f"soak: {ENGINES} engines ({' '.join(engine_args)}), router at {fleet.router_url} "
            f"(pid {fleet.router_pid}), Redis on port {fleet.redis_port}",
            flush=True,
        )
        run = _run_async(soak(fleet, args))
        counters = router_counters(fleet.router_metrics())
        logs, tracebacks = summarize_logs(fleet.router_log())
    finally:
        fleet.close()
    rows = minute_rows(run.outcomes, run.samples, run.windows, run.duration, os.cpu_count() or 1)
    verdict = judge(run.outcomes, rows, run.windows)
    print()
    print(format_table(rows))
    print()
    client_cpu = 0.0
    if len(run.samples) > 1 and run.samples[-1].t > run.samples[0].t:
        first, last = run.samples[0], run.samples[-1]
        client_cpu = 100 * (last.client_cpu_s - first.client_cpu_s) / (last.t - first.t)
    print(
        f"capacity {run.capacity:.1f} answered/s, sent {run.rate:.1f} requests/s; pacer lag "
        f"at most {run.pacer_lag_max_s * 1e3:.0f} ms; load generator CPU {client_cpu:.0f}% "
        f"of a core; {run.unfinished} requests unfinished"
    )
    for window in run.windows:
        where = f" on {window.engine}" if window.engine else ""
        print(f"fault: {window.name}{where} from {window.start:.1f} s to {window.end:.1f} s")
    print("router counters at the end:")
    for name, value in counters.items():
        print(f"  {value:>8.0f} {name}")
    if logs:
        print("router log (warnings and errors, numbers elided):")
        for level, msg, count in logs:
            print(f"  {count:>6} {level}: {msg}")
    for traceback in tracebacks[:3]:
        print("router traceback:\n" + traceback)
    for line in format_verdict(verdict):
        print(line)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "command": " ".join(["python -m router.bench.soak", *(argv or sys.argv[1:])]),
        "engines": ENGINES,
        "engine_args": engine_args,
        "router_config": {"index": index_options, **ROUTER_CONFIG},
        "capacity_answered_per_s": run.capacity,
        "rate_per_s": run.rate,
        "ramp": [asdict(step) for step in run.ramp],
        "faults": [asdict(w) for w in run.windows],
        "minutes": [asdict(row) for row in rows],
        "pacer_lag_max_s": run.pacer_lag_max_s,
        "load_generator_cpu_percent": client_cpu,
        "router_counters": counters,
        "router_log": [{"level": lv, "msg": m, "count": n} for lv, m, n in logs],
        "router_tracebacks": tracebacks,
        "samples": [asdict(sample) for sample in run.samples],
        "requests": {
            "fields": ["sent_at", "ended_at", "kind", "status", "engine", "answered", "reason"],
            "rows": [
                [
                    round(o.sent_at, 3),
                    round(o.ended_at, 3),
                    o.kind,
                    o.status,
                    o.engine,
                    o.answered,
                    ("lost: " if o.lost else "") + o.reason,
                ]
                for o in run.outcomes
            ],
        },
        "verdict": {
            "passed": verdict.passed,
            "requests": verdict.requests,
            "lost": verdict.lost,
            "failed": verdict.failed,
            "attributed": verdict.attributed,
            "unexplained": [asdict(o) for o in verdict.unexplained],
            "rss_from": verdict.rss_from,
            "rss_to": verdict.rss_to,
            "rss_growth": verdict.rss_growth,
        },
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
