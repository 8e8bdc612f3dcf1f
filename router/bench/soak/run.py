"""``python -m router.bench.soak``: the fleet, the load and the faults wired together.

:func:`soak` measures capacity, then sends the open-loop stream while the faults run
and the fleet is sampled; :func:`main` parses the flags, runs it, prints the report and
writes it (the package's docstring says what each part does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from router.bench.soak.fleet import (
    ENGINE_ARGS,
    ENGINES,
    REDIS_BUDGET_MS,
    ROUTER_CONFIG,
    Fleet,
    inject_faults,
    sample_fleet,
)
from router.bench.soak.report import (
    Outcome,
    RouterSummary,
    SoakRun,
    document,
    format_summary,
    format_table,
    format_verdict,
    judge,
    minute_rows,
)
from router.bench.soak.sender import RequestMix, measure_capacity, send

T = TypeVar("T")


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
    """Measure capacity, then the open-loop soak with faults (the package docstring)."""
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
            asyncio.ensure_future(sample_fleet(fleet, session, origin, 2.0, run.samples)),
            asyncio.ensure_future(_progress(run, origin, lambda: len(pending))),
        ]
        faults = inject_faults(fleet, session, origin, duration, run.windows)
        injector = asyncio.ensure_future(faults)
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


def parser() -> argparse.ArgumentParser:
    """The soak's flags (docs/reliability.md)."""
    parser = argparse.ArgumentParser(
        prog="python -m router.bench.soak",
        description="Soak the router: open-loop load at a share of measured capacity, "
        "with an engine restart, a Redis restart and a stalled engine on a schedule.",
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
        help=f"the router's index.redis.budget_ms (default {REDIS_BUDGET_MS:.0f}; 0: the router's "
        "own default)",
    )
    parser.add_argument(
        "--index",
        choices=("redis", "replicated"),
        default="redis",
        help="the router's index.backend: the shared Redis index (default) or the "
        "replicated mode (an index in memory, decisions through a Redis stream)",
    )
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="bench-results/soak.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    flags = parser()
    args = flags.parse_args(argv)
    if args.minutes <= 0 or not 0 < args.load <= 1.5:
        flags.error("--minutes must be positive and --load in (0, 1.5]")
    signal.signal(signal.SIGTERM, _terminate)
    # A small batch and a slowed clock make the engines the bottleneck, not the two CPU
    # cores that run everything, the load generator included.
    engine_args = [
        "--max-num-seqs", str(args.max_num_seqs), "--time-scale", str(args.time_scale),
        *ENGINE_ARGS,
    ]  # fmt: skip
    index_options = {"budget_ms": args.redis_budget_ms} if args.redis_budget_ms else {}
    fleet = Fleet(
        ENGINES,
        engine_args,
        start_timeout=60.0,
        index_options=index_options,
        index_backend=args.index,
    )
    try:
        fleet.start()
        print(
            f"soak: {ENGINES} engines ({' '.join(engine_args)}), router at {fleet.router_url} "
            f"(pid {fleet.router_pid}), Redis on port {fleet.redis_port}",
            flush=True,
        )
        run = _run_async(soak(fleet, args))
        router = RouterSummary.of(fleet.router_metrics(), fleet.router_log())
    finally:
        fleet.close()
    rows = minute_rows(run.outcomes, run.samples, run.windows, run.duration, os.cpu_count() or 1)
    verdict = judge(run.outcomes, rows, run.windows)
    print()
    print(format_table(rows))
    print()
    for line in format_summary(run, router):
        print(line)
    for line in format_verdict(verdict):
        print(line)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    setup = {
        "command": " ".join(["python -m router.bench.soak", *(argv or sys.argv[1:])]),
        "engines": ENGINES,
        "engine_args": engine_args,
        "router_config": {"index": {"redis": index_options}, **ROUTER_CONFIG},
    }
    report = document(run, rows, verdict, router, setup)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if verdict.passed else 1
