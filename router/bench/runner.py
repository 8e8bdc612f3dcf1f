"""Run one workload against one target and record what the client and the engines saw.

The client side comes from :func:`router.bench.loadgen.run_load` (TTFT, inter-token gaps,
end-to-end time, usage). The engine side comes from each engine's Prometheus
``/metrics`` under vLLM's names: read before the first request, every
``sample_interval`` seconds while the workload runs (load and hit rate over time), and
after the last answer once the engines are idle. The difference of the prefix-cache
counters is the true hit rate, whatever router sat in front of the engines; that of the
engines' TTFT and end-to-end histograms separates what the engines' schedule did to
latency from what the path between client and engine added.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.bench.loadgen import Result, run_load
from router.workloads.spec import RequestSpec

#: Engine metric -> EngineSnapshot field. Counters are cumulative; gauges instantaneous.
COUNTERS = {
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:prefix_cache_hits_total": "hits",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:e2e_request_latency_seconds_count": "finished",
    "vllm:e2e_request_latency_seconds_sum": "e2e_sum",
    "vllm:time_to_first_token_seconds_count": "first_tokens",
    "vllm:time_to_first_token_seconds_sum": "ttft_sum",
}
GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:token_usage": "kv_usage",
}


@dataclass(slots=True)
class EngineSnapshot:
    """One engine's metrics at one moment (summed over data-parallel ranks)."""

    t: float
    """Seconds after the workload started."""
    ok: bool = True
    queries: float = 0.0
    hits: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    preemptions: float = 0.0
    finished: float = 0.0
    e2e_sum: float = 0.0
    """Seconds the finished requests took, arrival at the engine to their last token."""
    first_tokens: float = 0.0
    ttft_sum: float = 0.0
    """Seconds from arrival at the engine to the first token, summed."""
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    block_size: int | None = None


def parse_engine_metrics(text: str, t: float) -> EngineSnapshot:
    """The fields of :class:`EngineSnapshot` from Prometheus text."""
    snap = EngineSnapshot(t)
    names = COUNTERS | GAUGES
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            attr = names.get(sample.name)
            if attr is not None:
                setattr(snap, attr, getattr(snap, attr) + sample.value)
            elif sample.name in ("vllm:cache_config_info", "sglang:cache_config_info"):
                size = sample.labels.get("block_size") or sample.labels.get("page_size")
                if size and size.isdigit():
                    snap.block_size = int(size)
    return snap


async def scrape(session: aiohttp.ClientSession, url: str, t: float) -> EngineSnapshot:
    """One engine's metrics, or a snapshot marked not ok if it could not be read."""
    try:
        async with session.get(f"{url}/metrics") as resp:
            if resp.status != 200:
                return EngineSnapshot(t, ok=False)
            return parse_engine_metrics(await resp.text(), t)
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
        return EngineSnapshot(t, ok=False)


@dataclass(slots=True)
class TargetRun:
    """Everything one run recorded; :mod:`router.bench.report` turns it into numbers."""

    name: str
    spec: str
    url: str
    engine_urls: list[str]
    results: list[Result]
    duration: float
    before: list[EngineSnapshot] = field(default_factory=list)
    after: list[EngineSnapshot] = field(default_factory=list)
    samples: list[list[EngineSnapshot]] = field(default_factory=list)
    """One list per engine, in time order."""


class Progress:
    """A progress line on a stream: redrawn in place on a terminal, else every few seconds."""

    def __init__(
        self, label: str, total: int | None, stream: IO[str] | None = None, quiet: bool = False
    ) -> None:
        self.label = label
        self.total = total
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.tty = self.stream.isatty()
        self.every = 0.2 if self.tty else 10.0
        self.done = self.errors = 0
        self.started = time.monotonic()
        self._last = 0.0

    def update(self, result: Result) -> None:
        self.done += 1
        self.errors += 0 if result.ok else 1
        now = time.monotonic()
        if now - self._last >= self.every:
            self._last = now
            self._draw(final=False)

    def _draw(self, final: bool) -> None:
        if self.quiet:
            return
        elapsed = time.monotonic() - self.started
        if self.total:
            filled = int(20 * min(self.done / self.total, 1.0))
            bar = f"[{'#' * filled}{'.' * (20 - filled)}] {self.done}/{self.total}"
        else:
            bar = f"{self.done} done"
        line = f"{self.label}: {bar}, {self.errors} errors, {elapsed:.0f} s"
        if self.tty:
            self.stream.write(f"\r{line}\x1b[K" + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        self._draw(final=True)


async def _sampler(
    session: aiohttp.ClientSession,
    urls: Sequence[str],
    interval: float,
    started: float,
    out: list[list[EngineSnapshot]],
) -> None:
    while True:
        t = time.perf_counter() - started
        snaps = await asyncio.gather(*(scrape(session, u, t) for u in urls))
        for series, snap in zip(out, snaps, strict=True):
            series.append(snap)
        await asyncio.sleep(interval)


async def _settled(
    session: aiohttp.ClientSession, urls: Sequence[str], started: float, timeout: float
) -> list[EngineSnapshot]:
    """The engines' metrics once none of them has work left (or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        t = time.perf_counter() - started
        snaps = list(await asyncio.gather(*(scrape(session, u, t) for u in urls)))
        idle = all(s.running + s.waiting == 0 for s in snaps if s.ok)
        if idle or time.monotonic() > deadline:
            return snaps
        await asyncio.sleep(0.05)


async def run_target(
    name: str,
    spec: str,
    url: str,
    engine_urls: Sequence[str],
    specs: Sequence[RequestSpec],
    *,
    concurrency: int,
    model: str | None = None,
    timeout: float = 300.0,
    sample_interval: float = 1.0,
    total: int | None = None,
    quiet: bool = False,
    stop_after: float | None = None,
    on_result: Callable[[Result], None] | None = None,
    api: str = "openai",
) -> TargetRun:
    """Send ``specs`` to ``url`` while sampling the engines; see the module docstring."""
    progress = Progress(name, total if total is not None else len(specs), quiet=quiet)

    def record(result: Result) -> None:
        progress.update(result)
        if on_result is not None:
            on_result(result)

    scrape_timeout = aiohttp.ClientTimeout(total=max(2.0, sample_interval))
    async with aiohttp.ClientSession(timeout=scrape_timeout) as session:
        before = list(await asyncio.gather(*(scrape(session, u, 0.0) for u in engine_urls)))
        samples: list[list[EngineSnapshot]] = [[] for _ in engine_urls]
        started = time.perf_counter()
        sampler = asyncio.ensure_future(
            _sampler(session, engine_urls, sample_interval, started, samples)
        )
        try:
            results = await run_load(
                url,
                specs,
                concurrency=concurrency,
                model=model,
                timeout=timeout,
                on_result=record,
                stop_after=stop_after,
                api=api,
            )
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            progress.close()
        duration = time.perf_counter() - started
        after = await _settled(session, engine_urls, started, timeout=10.0)
        for series, snap in zip(samples, after, strict=True):
            series.append(snap)
    return TargetRun(name, spec, url, list(engine_urls), results, duration, before, after, samples)
