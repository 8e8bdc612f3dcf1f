"""The soak's report: pure maths over what a run recorded.

The records (:class:`Outcome` per request, :class:`FaultWindow` per injected fault,
:class:`Sample` of the router and the machine, :class:`RampStep` of the capacity ramp,
all of a run in :class:`SoakRun`), then which fault a failure is owed to
(:func:`attribute`), the per-minute table (:func:`minute_rows`), the verdict
(:func:`judge`), and the text and JSON the soak prints and writes. Nothing here starts a
process or opens a socket.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from router.workloads.stats import percentile

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
#: Seconds after a fault ends during which its engine's failures are still its own
#: (a request stalled just before the fault was cleared fails an idle timeout later).
GRACE_S = 10.0
WARMUP_MINUTE = 2
RSS_TOLERANCE = 0.10


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


@dataclass(slots=True)
class RampStep:
    """One level of the capacity ramp."""

    concurrency: int
    answered_per_s: float
    p99_ms: float
    failed: int


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


# ------------------------------------------------------------------------------ maths


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


@dataclass(slots=True)
class RouterSummary:
    """What the router said about itself at the end: its counters and its log."""

    counters: dict[str, float]
    logs: list[tuple[str, str, int]]
    """(level, message with numbers elided, count), most frequent first."""
    tracebacks: list[str]

    @classmethod
    def of(cls, metrics_text: str, log_text: str) -> RouterSummary:
        logs, tracebacks = summarize_logs(log_text)
        return cls(router_counters(metrics_text), logs, tracebacks)


def client_cpu_percent(samples: Sequence[Sample]) -> float:
    """The load generator's CPU over the run, in percent of one core."""
    if len(samples) > 1 and samples[-1].t > samples[0].t:
        first, last = samples[0], samples[-1]
        return 100 * (last.client_cpu_s - first.client_cpu_s) / (last.t - first.t)
    return 0.0


def format_summary(run: SoakRun, router: RouterSummary) -> list[str]:
    """The lines between the table and the verdict: the load, the faults, the router."""
    lines = [
        f"capacity {run.capacity:.1f} answered/s, sent {run.rate:.1f} requests/s; pacer lag "
        f"at most {run.pacer_lag_max_s * 1e3:.0f} ms; load generator CPU "
        f"{client_cpu_percent(run.samples):.0f}% of a core; {run.unfinished} requests "
        f"unfinished"
    ]
    for window in run.windows:
        where = f" on {window.engine}" if window.engine else ""
        lines.append(f"fault: {window.name}{where} from {window.start:.1f} s to {window.end:.1f} s")
    lines.append("router counters at the end:")
    lines += [f"  {value:>8.0f} {name}" for name, value in router.counters.items()]
    if router.logs:
        lines.append("router log (warnings and errors, numbers elided):")
        lines += [f"  {count:>6} {level}: {msg}" for level, msg, count in router.logs]
    lines += ["router traceback:\n" + traceback for traceback in router.tracebacks[:3]]
    return lines


def document(
    run: SoakRun,
    rows: Sequence[MinuteRow],
    verdict: Verdict,
    router: RouterSummary,
    setup: dict[str, Any],
) -> dict[str, Any]:
    """The JSON the soak writes to ``--output``: ``setup`` (the command, the engines and
    the router's settings) first, then everything the run recorded and the verdict."""
    return {
        **setup,
        "capacity_answered_per_s": run.capacity,
        "rate_per_s": run.rate,
        "ramp": [asdict(step) for step in run.ramp],
        "faults": [asdict(w) for w in run.windows],
        "minutes": [asdict(row) for row in rows],
        "pacer_lag_max_s": run.pacer_lag_max_s,
        "load_generator_cpu_percent": client_cpu_percent(run.samples),
        "router_counters": router.counters,
        "router_log": [{"level": lv, "msg": m, "count": n} for lv, m, n in router.logs],
        "router_tracebacks": router.tracebacks,
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
