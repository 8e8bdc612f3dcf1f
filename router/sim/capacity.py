"""``kvroute plan``: which prefill:decode split of a GPU budget serves a workload best.

For every candidate fleet of ``--gpus`` engines (colocated, and each ``P`` prefill +
``D`` decode split) the planner finds, with the simulator, the highest arrival rate at
which at least ``--attainment`` of the requests meet both SLOs (time to first token
and mean inter-token latency): the fleet's *goodput*, as DistServe defines it. The rate
is the workload's own arrival process sped up or slowed down; the search brackets it by
doubling or halving, then bisects geometrically. The fleet with the highest goodput is
recommended, and every fleet's frontier point is printed.

``--sweep-lengths`` asks the other question: for which request shapes does moving the
prefill to another engine pay at all? It compares one colocated engine pair with one
prefill + one decode engine on uniform workloads of unique prompts, over a grid of
prompt and output lengths, with the split forced for every request.

``--sweep-threshold`` asks it per request, on one prefill/decode fleet and a mixed
workload: below how many uncached prompt tokens should a request be served by its
decode engine alone (``disaggregation.min_uncached_tokens``)? Each threshold's goodput
comes from the same search.

``--compare-layouts`` asks where the pools should sit: one prefill/decode fleet on
``--racks`` racks, packed (each rack holds its share of both pools) against spread (the
pools on different racks), with each rack's uplink shared by the transfers crossing it
(``--rack-uplink-gb-s``); the router knows the layout, as ``engines[].topology``.

Examples::

    kvroute plan --trace mooncake-conversation --requests 1500 --gpus 8 \\
        --ttft-slo-ms 2000 --itl-slo-ms 50
    kvroute plan --sweep-lengths --gpus 2 --ttft-slo-ms 500 --itl-slo-ms 30
    kvroute plan --sweep-threshold --fleet 2P+2D --trace azure-conv --requests 3000
    kvroute plan --compare-layouts --fleet 4P+4D --racks 2 --trace mooncake-synthetic \
        --requests 600
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from router import __version__
from router.config import Config, ConfigError, load_config
from router.engine_model import EngineParams
from router.engine_model.flags import add_model_arguments
from router.policy import DEFAULT_POLICY, POLICY_NAMES
from router.sim.cli import (
    INFINITE_BLOCKS,
    add_layout_arguments,
    add_router_arguments,
    layout_of,
    model_params,
    parse_fleet,
    settings_for,
    simulate,
)
from router.sim.cluster import LAYOUTS, Fleet, SimRun
from router.workloads.flags import add_workload_arguments, build_workload
from router.workloads.spec import RequestSpec
from router.workloads.tables import render_markdown, render_text
from router.workloads.traces import TraceError


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency targets a request must meet to count toward goodput."""

    ttft_s: float
    itl_s: float
    attainment: float
    """Share of requests that must meet both for a rate to be sustainable."""

    def met(self, run: SimRun) -> float:
        """The share of the run's requests that met both targets."""
        if not run.records:
            return 0.0
        good = 0
        for r in run.records:
            itl = (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
            if r.ttft <= self.ttft_s and itl <= self.itl_s:
                good += 1
        return good / len(run.records)


@dataclass(slots=True)
class Point:
    """One fleet's best sustainable rate and what the run at that rate showed."""

    fleet: Fleet
    rate: float
    """Requests per second sustained within the SLOs (0: not even the slowest rate)."""
    attainment: float
    summary: dict[str, Any] | None
    runs: int

    @property
    def per_gpu(self) -> float:
        return self.rate / self.fleet.gpus


def candidate_fleets(gpus: int, colocated: bool = True) -> list[Fleet]:
    """The colocated fleet and every prefill + decode split of ``gpus`` engines."""
    fleets = [Fleet(engines=gpus)] if colocated else []
    fleets += [Fleet(prefill=p, decode=gpus - p) for p in range(1, gpus)]
    return fleets


def at_rate(specs: Sequence[RequestSpec], factor: float) -> list[RequestSpec]:
    """The workload with its arrival times divided by ``factor`` (rate times ``factor``)."""
    return [replace(s, at=None if s.at is None else s.at / factor) for s in specs]


def base_rate(specs: Sequence[RequestSpec]) -> float:
    """Arrivals per second of the timed workload."""
    times = [s.at for s in specs if s.at is not None]
    span = max(times) - min(times) if times else 0.0
    return (len(times) - 1) / span if span > 0 else float(len(times))


def poisson_arrivals(specs: Sequence[RequestSpec], rate: float, seed: int) -> list[RequestSpec]:
    """Give untimed requests Poisson arrivals at ``rate`` per second."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for spec in specs:
        out.append(replace(spec, at=t))
        t += rng.expovariate(rate)
    return out


def search_rate(
    evaluate: Callable[[float], tuple[float, SimRun]],
    slo: Slo,
    start: float,
    steps: int,
    limit: float = 64.0,
) -> tuple[float, float, SimRun | None, int]:
    """The largest factor within ``slo`` (bracketed by doubling or halving from
    ``start``, then bisected geometrically ``steps`` times).

    Returns (factor, attainment there, the run there, runs made); factor 0 when not
    even ``start / limit`` meets the SLOs.
    """
    runs = 0
    cache: dict[float, tuple[float, SimRun]] = {}

    def ok(factor: float) -> bool:
        nonlocal runs
        if factor not in cache:
            runs += 1
            cache[factor] = evaluate(factor)
        return cache[factor][0] >= slo.attainment

    good = bad = None
    factor = start
    if ok(factor):
        good = factor
        while good < start * limit:
            factor = good * 2
            if not ok(factor):
                bad = factor
                break
            good = factor
    else:
        bad = factor
        while bad > start / limit:
            factor = bad / 2
            if ok(factor):
                good = factor
                break
            bad = factor
    if good is None:
        return 0.0, cache[bad][0] if bad is not None else 0.0, None, runs
    if bad is not None:
        for _ in range(steps):
            middle = math.sqrt(good * bad)
            if ok(middle):
                good = middle
            else:
                bad = middle
    attainment, run = cache[good]
    return good, attainment, run, runs


def plan_fleets(
    fleets: Sequence[Fleet],
    workload_at: Callable[[float], Sequence[RequestSpec]],
    rate0: float,
    make_settings: Callable[[Fleet], Any],
    slo: Slo,
    steps: int,
    progress: Callable[[Point], None] | None = None,
) -> list[Point]:
    """Each fleet's goodput: ``workload_at(factor)`` is the workload at ``factor`` times
    its base rate ``rate0`` (requests per second)."""
    points = []
    for fleet in fleets:
        settings = make_settings(fleet)

        def evaluate(factor: float, settings: Any = settings) -> tuple[float, SimRun]:
            run = simulate(settings, workload_at(factor), "plan")
            return slo.met(run), run

        factor, attainment, run, count = search_rate(evaluate, slo, 1.0, steps)
        point = Point(fleet, rate0 * factor, attainment, run.summary() if run else None, count)
        points.append(point)
        if progress is not None:
            progress(point)
    return points


def _ms(summary: dict[str, Any], key: str, q: str) -> str:
    """A latency of a run's summary (``ttft_s``, ``p99``) in milliseconds, or ``-``."""
    value = (summary.get(key) or {}).get(q)
    return "-" if value is None else f"{value * 1e3:,.0f} ms"


def frontier_rows(points: Sequence[Point]) -> list[list[str]]:
    """One row per fleet (the line under the table names the recommended one)."""
    rows = [
        [
            "fleet",
            "goodput req/s",
            "per GPU",
            "within SLOs",
            "TTFT p50",
            "TTFT p99",
            "ITL p99",
            "hit rate",
            "split share",
        ]
    ]
    for p in points:
        s = p.summary or {}
        split = s.get("split_share")
        rows.append(
            [
                p.fleet.describe(),
                f"{p.rate:.2f}",
                f"{p.per_gpu:.3f}",
                f"{p.attainment:.0%}" if p.summary else "-",
                _ms(s, "ttft_s", "p50"),
                _ms(s, "ttft_s", "p99"),
                _ms(s, "itl_s", "p99"),
                f"{s['hit_rate']:.1%}" if s.get("hit_rate") is not None else "-",
                f"{split:.0%}" if split is not None else "-",
            ]
        )
    return rows


# ------------------------------------------------------------------------------ lengths


def uniform_workload(
    duration_s: float, minimum: int, prompt_tokens: int, output_tokens: int, rate: float, seed: int
) -> list[RequestSpec]:
    """Unique prompts of one shape arriving as a Poisson process at ``rate`` for
    ``duration_s`` seconds (at least ``minimum`` of them), so every rate is judged on a
    steady state rather than on how fast a short burst drains.

    Prompts differ in their first block only: with chained keys nothing after it can
    match, so no prompt reuses another's cache.
    """
    rng = random.Random(f"{seed}:{prompt_tokens}:{output_tokens}")
    body = [rng.randrange(1_024, 32_000) for _ in range(prompt_tokens)]
    head = min(16, prompt_tokens)
    count = max(minimum, math.ceil(rate * duration_s))
    specs = [
        RequestSpec(
            prompt=[rng.randrange(1_024, 32_000) for _ in range(head)] + body[head:],
            max_tokens=output_tokens,
        )
        for _ in range(count)
    ]
    return poisson_arrivals(specs, rate, seed)


def sweep_lengths(
    args: argparse.Namespace, params: EngineParams, config: Config, slo: Slo
) -> list[list[str]]:
    """Goodput of colocated vs split pairs per (prompt, output) length."""
    forced = config.model_copy(
        update={
            "disaggregation": config.disaggregation.model_copy(
                update={"min_uncached_tokens": 0, "decode_hit_ratio": 1.0}
            )
        }
    )
    gpus = max(args.gpus, 2)
    fleets = [Fleet(engines=gpus), Fleet(prefill=gpus // 2, decode=gpus - gpus // 2)]
    rows = [["prompt", "output", "colocated req/s", "split req/s", "split/colocated", "pays"]]
    for isl in args.prompt_lengths:
        for osl in args.output_lengths:
            # Offered load per GPU held equal across shapes: about half an engine's
            # prefill capacity, so the search starts near the interesting range.
            prefill_s = params.step_overhead_s + isl * params.prefill_token_s
            rate = 0.5 * gpus / (prefill_s + osl * params.step_overhead_s / 8)
            points = plan_fleets(
                fleets,
                lambda f, isl=isl, osl=osl, rate=rate: uniform_workload(
                    args.sweep_seconds, args.sweep_requests, isl, osl, rate * f, args.seed
                ),
                rate,
                lambda fleet, c=forced: settings_for(fleet, args.policy, params, c, args, 8),
                slo,
                args.search_steps,
            )
            colocated, split = points
            ratio = split.rate / colocated.rate if colocated.rate else math.inf
            rows.append(
                [
                    f"{isl:,}",
                    f"{osl:,}",
                    f"{colocated.rate:.2f}",
                    f"{split.rate:.2f}",
                    f"{ratio:.2f}x" if math.isfinite(ratio) else "-",
                    "yes" if ratio > 1.05 else "no",
                ]
            )
            if not args.quiet:
                print(f"  prompt {isl}, output {osl}: split/colocated {ratio:.2f}x", flush=True)
    return rows


# ------------------------------------------------------------------------------ threshold


def _pd_fleet(args: argparse.Namespace, flag: str) -> Fleet:
    """``--fleet`` (half the GPUs prefill by default), which ``flag`` needs split."""
    fleet = parse_fleet(args.fleet or f"{args.gpus // 2}P+{args.gpus - args.gpus // 2}D")
    if not fleet.disaggregated or not fleet.prefill:
        raise ValueError(f"{flag} needs a prefill/decode fleet, not {fleet.describe()}")
    return fleet


#: Stands for "never split" in the threshold sweep.
NEVER = 10**9


def sweep_threshold(
    args: argparse.Namespace,
    params: EngineParams,
    config: Config,
    slo: Slo,
    specs: Sequence[RequestSpec],
    concurrency: int,
) -> list[list[str]]:
    """Goodput of one prefill/decode fleet per ``min_uncached_tokens`` threshold."""
    fleet = _pd_fleet(args, "--sweep-threshold")
    rows = [
        ["split when uncached >=", "goodput req/s", "split share", "TTFT p50", "TTFT p99",
         "ITL p99", "best"]
    ]  # fmt: skip
    points = []
    for threshold in args.thresholds:
        disagg = config.disaggregation.model_copy(update={"min_uncached_tokens": threshold})
        cfg = config.model_copy(update={"disaggregation": disagg})
        (point,) = plan_fleets(
            [fleet],
            lambda factor: at_rate(specs, factor),
            base_rate(specs),
            lambda f, c=cfg: settings_for(f, args.policy, params, c, args, concurrency),
            slo,
            args.search_steps,
        )
        points.append((threshold, point))
        if not args.quiet:
            label = "never" if threshold >= NEVER else f"{threshold:,} tokens"
            print(f"  {label}: {point.rate:.2f} req/s within the SLOs", flush=True)
    best = max(points, key=lambda tp: tp[1].rate)
    for threshold, point in points:
        s = point.summary or {}
        split = s.get("split_share")
        rows.append(
            [
                "never" if threshold >= NEVER else f"{threshold:,}",
                f"{point.rate:.2f}",
                f"{split:.0%}" if split is not None else "-",
                _ms(s, "ttft_s", "p50"),
                _ms(s, "ttft_s", "p99"),
                _ms(s, "itl_s", "p99"),
                "yes" if point is best[1] and point.rate > 0 else "",
            ]
        )
    return rows


# ------------------------------------------------------------------------------ layouts


def compare_layouts(
    args: argparse.Namespace,
    params: EngineParams,
    config: Config,
    slo: Slo,
    specs: Sequence[RequestSpec],
    concurrency: int,
) -> list[list[str]]:
    """Goodput of one prefill/decode fleet per layout on ``--racks`` racks."""
    fleet = _pd_fleet(args, "--compare-layouts")
    if args.racks is None:
        args.racks = 2
    rows = [
        ["layout", "goodput req/s", "within SLOs", "TTFT p50", "TTFT p99", "ITL p99",
         "split share", "splits crossing racks", "best"]
    ]  # fmt: skip
    points = []
    for style in LAYOUTS:
        layout = layout_of(args, style)
        (point,) = plan_fleets(
            [fleet],
            lambda factor: at_rate(specs, factor),
            base_rate(specs),
            lambda f, layout=layout: settings_for(
                f, args.policy, params, config, args, concurrency, layout
            ),
            slo,
            args.search_steps,
        )
        points.append((layout, point))
        if not args.quiet:
            print(f"  {style}: {point.rate:.2f} req/s within the SLOs", flush=True)
    best = max(points, key=lambda lp: lp[1].rate)
    for layout, point in points:
        s = point.summary or {}
        split, crossing = s.get("split_share"), s.get("cross_rack_share")
        rows.append(
            [
                layout.describe() if layout else "-",
                f"{point.rate:.2f}",
                f"{point.attainment:.0%}" if point.summary else "-",
                _ms(s, "ttft_s", "p50"),
                _ms(s, "ttft_s", "p99"),
                _ms(s, "itl_s", "p99"),
                f"{split:.0%}" if split is not None else "-",
                f"{crossing:.0%}" if crossing is not None else "-",
                "yes" if point is best[1] and point.rate > 0 else "",
            ]
        )
    return rows


# ------------------------------------------------------------------------------ command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``kvroute plan`` (docs/simulator.md describes each)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1] if __doc__ else None
    budget = parser.add_argument_group("budget and SLOs")
    budget.add_argument("--gpus", type=int, default=8, help="engines (GPUs) to divide")
    budget.add_argument(
        "--ttft-slo-ms", type=float, default=2_000.0, help="time-to-first-token target"
    )
    budget.add_argument(
        "--itl-slo-ms", type=float, default=50.0, help="mean inter-token latency target"
    )
    budget.add_argument(
        "--attainment",
        type=float,
        default=0.9,
        help="share of requests that must meet both targets",
    )
    budget.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        choices=POLICY_NAMES,
        help="routing policy of every simulated fleet",
    )
    budget.add_argument(
        "--no-colocated", action="store_true", help="search prefill:decode splits only"
    )
    budget.add_argument(
        "--rate",
        type=float,
        default=4.0,
        help="requests/s a generated workload (no arrival times) starts the search from",
    )
    budget.add_argument(
        "--search-steps", type=int, default=4, help="bisection steps after the bracket"
    )
    sweep = parser.add_argument_group("where disaggregation pays (--sweep-lengths)")
    sweep.add_argument(
        "--sweep-lengths",
        action="store_true",
        help="compare colocated and split pairs over a grid of prompt and output lengths",
    )
    sweep.add_argument(
        "--prompt-lengths",
        type=int,
        nargs="+",
        default=[128, 256, 512, 1_024, 2_048, 4_096],
        metavar="N",
        help="prompt lengths of the sweep",
    )
    sweep.add_argument(
        "--output-lengths",
        type=int,
        nargs="+",
        default=[50, 200, 800],
        metavar="N",
        help="output lengths of the sweep",
    )
    sweep.add_argument(
        "--sweep-seconds",
        type=float,
        default=60.0,
        help="seconds of arrivals each rate of the sweep is judged on",
    )
    sweep.add_argument(
        "--sweep-requests", type=int, default=200, help="fewest requests per rate of the sweep"
    )
    threshold = parser.add_argument_group("when a request should be split (--sweep-threshold)")
    threshold.add_argument(
        "--sweep-threshold",
        action="store_true",
        help="goodput of one prefill/decode fleet per disaggregation.min_uncached_tokens",
    )
    threshold.add_argument(
        "--fleet",
        metavar="PP+DD",
        help="the fleet of the threshold sweep and the layout comparison (default: half and half)",
    )
    threshold.add_argument(
        "--thresholds",
        type=int,
        nargs="+",
        default=[0, 128, 256, 512, 1_024, 2_048, 4_096, NEVER],
        metavar="N",
        help=f"thresholds to try ({NEVER} = never split)",
    )
    add_layout_arguments(parser).add_argument(
        "--compare-layouts",
        action="store_true",
        help="goodput of one prefill/decode fleet (--fleet) packed vs spread on --racks racks",
    )
    add_model_arguments(parser).add_argument(
        "--infinite-cache", action="store_true", help="every engine's KV cache is unbounded"
    )
    add_router_arguments(parser)
    add_workload_arguments(parser, trace_alias=True, prompt_format="tokens")
    out = parser.add_argument_group("output")
    out.add_argument(
        "--output",
        metavar="DIR",
        help="also write the table to DIR/results.json and DIR/summary.md (default: print only)",
    )
    out.add_argument("--quiet", action="store_true", help="no line per searched fleet")


def _table(args: argparse.Namespace, rows: list[list[str]], about: dict[str, Any]) -> None:
    """Print the result table and, with ``--output``, write it as JSON and markdown."""
    print()
    print(render_text(rows))
    if not args.output:
        return
    header, *body = rows
    document = {
        "kvroute_version": __version__,
        "command": " ".join(["kvroute", *sys.argv[1:]]) if sys.argv[1:2] == ["plan"] else None,
        **about,
        "table": [dict(zip(header, row, strict=True)) for row in body],
    }
    outdir = Path(args.output)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "results.json").write_text(json.dumps(document, indent=1) + "\n")
    (outdir / "summary.md").write_text(render_markdown(rows) + "\n")
    print(f"\nwrote {outdir / 'results.json'}, {outdir / 'summary.md'}")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``kvroute plan``."""
    try:
        if args.gpus < 1:
            raise ValueError("--gpus must be at least 1")
        if not 0 < args.attainment <= 1:
            raise ValueError("--attainment must be in (0, 1]")
        params = model_params(args)
        config = load_config(args.config)
        slo = Slo(args.ttft_slo_ms / 1e3, args.itl_slo_ms / 1e3, args.attainment)
    except (ConfigError, ValueError) as exc:
        print(f"kvroute plan: {exc}", file=sys.stderr)
        return 2
    targets = (
        f"TTFT <= {args.ttft_slo_ms:g} ms and mean ITL <= {args.itl_slo_ms:g} ms "
        f"for {args.attainment:.0%} of requests"
    )
    cache = (
        "unbounded" if params.num_gpu_blocks == INFINITE_BLOCKS else f"{params.num_gpu_blocks:,}"
    )
    print(
        f"engines   {args.preset}: block {params.block_size}, cache {cache} blocks, prefill "
        f"{params.prefill_token_s * 1e6:g} us/token, step {params.step_overhead_s * 1e3:g} ms, "
        f"KV {params.kv_bytes_per_token:,} B/token over {params.kv_transfer_bandwidth / 1e9:g} GB/s"
    )
    print(f"SLOs      {targets}")
    about: dict[str, Any] = {"slos": targets}
    if args.sweep_lengths:
        print(f"sweep     {max(args.gpus, 2)} GPUs, colocated vs split, unique prompts\n")
        rows = sweep_lengths(args, params, config, slo)
        _table(args, rows, {**about, "question": "sweep-lengths"})
        return 0
    try:
        workload = build_workload(args, compact=True)
    except (TraceError, ValueError, FileNotFoundError) as exc:
        print(f"kvroute plan: {exc}", file=sys.stderr)
        return 2
    specs = workload.specs
    if all(s.at is None for s in specs):
        specs = poisson_arrivals(specs, args.rate, args.seed)
    print(f"workload  {workload.description}")
    about["workload"] = workload.description
    if args.compare_layouts:
        print(
            f"layouts   {args.fleet or 'half prefill, half decode'} on {args.racks or 2} racks, "
            f"{args.rack_uplink_gb_s:g} GB/s uplinks\n"
        )
        try:
            rows = compare_layouts(args, params, config, slo, specs, workload.concurrency)
        except ValueError as exc:
            print(f"kvroute plan: {exc}", file=sys.stderr)
            return 2
        _table(args, rows, {**about, "question": "compare-layouts"})
        return 0
    if args.sweep_threshold:
        print(f"sweep     split thresholds on {args.fleet or 'half prefill, half decode'}\n")
        try:
            rows = sweep_threshold(args, params, config, slo, specs, workload.concurrency)
        except ValueError as exc:
            print(f"kvroute plan: {exc}", file=sys.stderr)
            return 2
        _table(args, rows, {**about, "question": "sweep-threshold"})
        return 0
    print(f"budget    {args.gpus} GPUs, policy {args.policy}\n")

    def progress(point: Point) -> None:
        if not args.quiet:
            print(
                f"  {point.fleet.describe()}: {point.rate:.2f} req/s within the SLOs "
                f"({point.runs} simulations)",
                flush=True,
            )

    points = plan_fleets(
        candidate_fleets(args.gpus, not args.no_colocated),
        lambda factor: at_rate(specs, factor),
        base_rate(specs),
        lambda fleet: settings_for(fleet, args.policy, params, config, args, workload.concurrency),
        slo,
        args.search_steps,
        progress,
    )
    best = max(points, key=lambda p: p.rate)
    recommended = best.fleet.describe() if best.rate > 0 else None
    rows = frontier_rows(points)
    _table(args, rows, {**about, "question": "fleets", "recommended": recommended})
    if best.rate <= 0:
        print("\nno fleet meets the SLOs even at 1/64 of the workload's rate")
        return 1
    print(
        f"\nrecommended: {best.fleet.describe()} ({best.rate:.2f} requests/s, "
        f"{best.per_gpu:.3f} per GPU, within the SLOs for {best.attainment:.0%})"
    )
    return 0
