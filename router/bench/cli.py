"""``kvroute bench``: replay a trace or a generated workload against OpenAI-compatible
targets and compare them side by side.

Examples::

    # a running deployment; hit rates read from its engines' /metrics
    kvroute bench --target http://127.0.0.1:8000 --engine-url http://10.0.0.5:8000 \\
        --workload mooncake-conversation --requests 500 --speedup 4 --scale 0.125

    # kvroute's default policy against round robin, each on 4 fresh emulated engines
    kvroute bench --engines 4 --compare kvroute=policy:default rr=policy:round_robin \\
        --baseline rr --workload chat --conversations 24 --turns 4

    # the same on 2 real vLLM engines per target (make bench-vllm has a whole command)
    kvroute bench --engines 2 --compare kvroute=policy:kv_cost rr=policy:round_robin \\
        --engine-cmd 'python -m vllm.entrypoints.openai.api_server --port {port} ...' \\
        --baseline rr --workload shared-prefix

    # an external router started by bench in front of the same kind of engines
    kvroute bench --engines 4 --compare kvroute=policy:kv_cost \\
        'sglang=cmd:python -m sglang_router.launch_router --worker-urls {engines}
         --policy cache_aware --host {host} --port {port}'

Prints a table: one column per target, a ``better`` column saying which way each
metric improves (``higher`` or ``lower``), and each target's ratio to the baseline
(its value over the baseline's). Writes ``results.json``, ``summary.md`` and PNG plots
to ``--output``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import statistics
import sys
import time
import urllib.request
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from router import __version__
from router.bench.apis import APIS
from router.workloads import tables
from router.workloads.flags import add_workload_arguments, build_workload
from router.workloads.traces import TraceError

T = TypeVar("T")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``kvroute bench`` (docs/benchmarks.md describes each)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1] if __doc__ else None
    what = parser.add_argument_group("targets")
    pick = what.add_mutually_exclusive_group(required=True)
    pick.add_argument(
        "--target",
        metavar="SPEC",
        help="one target: URL, policy:POLICY (kvroute serve started by bench) or cmd:COMMAND",
    )
    pick.add_argument(
        "--compare",
        nargs="+",
        metavar="NAME=SPEC",
        help="several targets, run in turn with the same workload and printed side by side",
    )
    what.add_argument(
        "--baseline", metavar="NAME", help="target the others are compared to (default: first)"
    )
    what.add_argument(
        "--rounds",
        type=_positive_int,
        default=1,
        metavar="N",
        help="run every target N times, interleaved (round 1 in the order given, round 2 in "
        "reverse, and so on, so a machine that slows down over the run weighs on every "
        "target alike); the table shows each number's median over the rounds and "
        "results.json keeps every round (default 1)",
    )
    what.add_argument(
        "--engines",
        type=int,
        default=0,
        metavar="N",
        help="start N fresh emulated engines for each policy:/cmd: target (caches start empty)",
    )
    what.add_argument(
        "--engine-cmd",
        metavar="TEMPLATE",
        help="with --engines N: start each engine with this command instead of 'kvroute "
        "engine' (a real vLLM, say); {port}, {i} and {dir} (a work directory) are filled "
        "in, and the engine is ready when its /health answers 200",
    )
    what.add_argument(
        "--engine-start-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds an --engine-cmd engine may take to become ready (default 600)",
    )
    what.add_argument(
        "--engine-args",
        default="",
        metavar="ARGS",
        help="extra 'kvroute engine' flags for started engines, e.g. '--time-scale 0.5'",
    )
    what.add_argument(
        "--engine-url",
        action="append",
        default=[],
        metavar="URL",
        help="an existing engine to read /metrics from (and to route to for policy:/cmd:)",
    )
    what.add_argument(
        "--reset-caches",
        action="store_true",
        help="POST /reset_prefix_cache to every --engine-url before each target",
    )
    what.add_argument(
        "--router-args", default="", metavar="ARGS", help="extra 'kvroute serve' flags"
    )
    what.add_argument("--model", help="model field of each request (default: the target's first)")
    what.add_argument(
        "--api",
        choices=sorted(APIS),
        default="openai",
        help="the client API requests use (openai: completions or chat by workload; "
        "responses: /v1/responses; messages: Anthropic Messages, /v1/messages)",
    )

    add_workload_arguments(parser)

    out = parser.add_argument_group("output")
    out.add_argument(
        "--output", default="bench-results/bench", metavar="DIR", help="where files go"
    )
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    out.add_argument(
        "--sample-interval", type=float, default=1.0, help="seconds between engine scrapes"
    )
    out.add_argument(
        "--timeout", type=float, default=600.0, help="seconds before a request is given up"
    )
    out.add_argument("--quiet", action="store_true", help="no progress line")


def _positive_int(text: str) -> int:
    """A whole number above 0."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: expected a whole number above 0")
    return value


def round_order(names: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, target) in the order ``--rounds`` runs them: round 1 as given, round 2
    reversed, round 3 as given, ..."""
    return [(r, name) for r in range(rounds) for name in (names if r % 2 == 0 else names[::-1])]


def median_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One target's summaries of several rounds as one: every number (at any depth) the
    median of the rounds' numbers, everything else the first round's."""
    first = rounds[0]
    if len(rounds) == 1:
        return first
    merged: dict[str, Any] = {}
    for key, value in first.items():
        values = [r.get(key) for r in rounds]
        if isinstance(value, dict) and all(isinstance(v, dict) for v in values):
            merged[key] = median_summary(values)  # type: ignore[arg-type]
        elif (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        ):
            merged[key] = statistics.median(values)  # type: ignore[type-var]
        else:
            merged[key] = value
    return merged


def _model_of(url: str) -> str | None:
    """The first model a target serves, or None if it does not say."""
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as response:
            data = json.loads(response.read())
        return str(data["data"][0]["id"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def _reset(urls: list[str]) -> None:
    for url in urls:
        request = urllib.request.Request(
            f"{url}/reset_prefix_cache", data=b"{}", headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()


def _command_line() -> str | None:
    """The command as typed, when this process is ``kvroute bench``."""
    if len(sys.argv) > 1 and sys.argv[1] == "bench":
        return shlex.join(["kvroute", *sys.argv[1:]])
    return None


def _run_async(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _can_plot() -> bool:
    """Whether the plots' package is installed: asked before the workload runs, not
    found missing after it (the plots come last)."""
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        return False
    return True


def run(args: argparse.Namespace) -> int:
    """Entry point of ``kvroute bench``.

    A target that cannot be started or run is reported (the reason printed and kept
    under ``failed`` in results.json) and the others still run. Exit status: 0 when at
    least one target answered a request, 1 when none did, 2 for bad flags or workloads.
    """
    # SIGTERM unwinds like Ctrl-C, so every engine and router bench started is stopped
    # (they run in process groups of their own, which a killed bench would orphan).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from router.bench import report
    from router.bench.runner import run_target
    from router.bench.targets import Stack, StackOptions, TargetError, parse_target

    if getattr(args, "tenants", None):
        return _run_tenants(args)
    if not args.no_plots and not _can_plot():
        print(
            "kvroute bench: the plots need the 'bench' extra (matplotlib is not installed): "
            "pip install 'kvroute[bench]', or run with --no-plots",
            file=sys.stderr,
        )
        return 2
    try:
        if args.compare:
            targets = [parse_target(text) for text in args.compare]
        else:
            targets = [parse_target(args.target)]
        names = [t.name for t in targets]
        if len(set(names)) != len(names):
            raise TargetError(f"target names must differ: {', '.join(names)}")
        baseline = args.baseline or names[0]
        if baseline not in names:
            raise TargetError(f"--baseline {baseline} is not one of {', '.join(names)}")
        workload = build_workload(args)
    except (TargetError, TraceError, ValueError, FileNotFoundError) as exc:
        print(f"kvroute bench: {exc}", file=sys.stderr)
        return 2

    options = StackOptions(
        engines=args.engines,
        engine_cmd=args.engine_cmd,
        engine_start_timeout=args.engine_start_timeout,
        engine_args=tuple(shlex.split(args.engine_args)),
        engine_urls=tuple(u.rstrip("/") for u in args.engine_url),
        router_args=tuple(shlex.split(args.router_args)),
    )
    print(f"workload  {workload.description}")
    kind = "engines started by --engine-cmd" if args.engine_cmd else "emulated engines"
    engines = f"{args.engines} fresh {kind} per target" if args.engines else ""
    if args.engines and args.engine_args and not args.engine_cmd:
        engines += f" ({args.engine_args})"
    print(f"engines   {engines or ', '.join(options.engine_urls) or 'not read (no --engine-url)'}")
    print(f"targets   {', '.join(f'{t.name}={t.spec}' for t in targets)}\n")

    outdir = Path(args.output)
    outdir.mkdir(parents=True, exist_ok=True)
    by_target: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
    # Targets that could not be started or run: kept with the reason, and the others go
    # on, so one broken peer router does not lose the whole comparison.
    failed: list[dict[str, str]] = []
    started = time.time()
    named = {t.name: t for t in targets}
    for round_, name in round_order(names, args.rounds):
        target = named[name]
        if any(f["name"] == name for f in failed):
            continue
        if args.rounds > 1:
            print(f"round {round_ + 1} of {args.rounds}: {name}", flush=True)
        try:
            if args.reset_caches and options.engine_urls:
                _reset(list(options.engine_urls))
            with Stack(target, options) as stack:
                model = args.model or _model_of(stack.url)
                run_ = _run_async(
                    run_target(
                        target.name,
                        target.spec,
                        stack.url,
                        stack.engine_urls,
                        workload.specs,
                        concurrency=workload.concurrency,
                        model=model,
                        timeout=args.timeout,
                        sample_interval=args.sample_interval,
                        total=workload.total,
                        quiet=args.quiet,
                        stop_after=args.duration if not workload.info.get("timed") else None,
                        api=args.api,
                    )
                )
        except (TargetError, OSError, RuntimeError, TimeoutError) as exc:
            reason = str(exc).strip() or type(exc).__name__
            print(f"kvroute bench: target {target.name} failed: {reason}", file=sys.stderr)
            failed.append({"name": target.name, "spec": target.spec, "reason": reason})
            continue
        summary = report.summarize_run(run_)
        by_target[name].append(summary)
        for example in summary["error_examples"]:
            print(f"  {target.name} error: {example}", file=sys.stderr)
    summaries = [median_summary(by_target[n]) for n in names if by_target[n]]

    requested_baseline = baseline
    if summaries and baseline not in {s["name"] for s in summaries}:
        baseline = summaries[0]["name"]
        print(
            f"kvroute bench: baseline {requested_baseline} failed; ratios are to {baseline}",
            file=sys.stderr,
        )
    failed_lines = [f"{f['name']}: {f['reason'].splitlines()[0]}" for f in failed]
    text = ""
    if summaries:
        rows = tables.table_rows(summaries, baseline, report.ROWS)
        print()
        print(tables.render_text(rows, keep=tables.LABEL_COLUMNS))
        text = tables.render_markdown(rows)
        if len(summaries) > 1:
            print(tables.ratio_note(baseline))
            text += "\n\n" + tables.ratio_note(baseline)
    for line in failed_lines:
        print(f"failed    {line}")
    print()
    for summary in summaries:
        print("\n".join(report.engine_lines(summary)))
    document = {
        "kvroute_version": __version__,
        "command": _command_line(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_time_s": time.time() - started,
        "workload": {"description": workload.description, "api": args.api, **workload.info},
        "engines": {"started_per_target": args.engines, "engine_args": args.engine_args},
        "baseline": baseline if summaries else None,
        "baseline_requested": requested_baseline,
        "targets": summaries,
        "failed": failed,
    }
    if args.rounds > 1:
        document["rounds"] = {n: runs for n, runs in by_target.items() if runs}
    report.write_json(outdir / "results.json", document)
    if failed_lines:
        text += "\n\nFailed (no results): " + "; ".join(failed_lines)
    (outdir / "summary.md").write_text(f"{workload.description}\n\n{text.strip()}\n")
    written = [outdir / "results.json", outdir / "summary.md"]
    if summaries and not args.no_plots:
        written += report.plot(summaries, outdir, workload.title)
    print(f"\nwrote {', '.join(str(p) for p in written)}")
    # Exit status: 0 when at least one target answered a request (failed targets and
    # targets that answered nothing are reported, not fatal), 1 when none did.
    if not any(s["ok"] > 0 for s in summaries):
        print("kvroute bench: no target answered a request", file=sys.stderr)
        return 1
    return 0


def _run_tenants(args: argparse.Namespace) -> int:
    """``kvroute bench --tenants``: every target in turn with the same tenants; a table
    per target, one row per tenant, and results.json."""
    from router.bench.targets import Stack, StackOptions, TargetError, parse_target
    from router.bench.tenants import parse_tenant, render_rows, run_tenants, summarize_tenant

    try:
        tenants = [parse_tenant(text) for text in args.tenants]
        specs = args.compare or [args.target]
        targets = [parse_target(text) for text in specs]
    except (TargetError, ValueError) as exc:
        print(f"kvroute bench: {exc}", file=sys.stderr)
        return 2
    duration = args.duration or 30.0
    options = StackOptions(
        engines=args.engines,
        engine_cmd=args.engine_cmd,
        engine_start_timeout=args.engine_start_timeout,
        engine_args=tuple(shlex.split(args.engine_args)),
        engine_urls=tuple(u.rstrip("/") for u in args.engine_url),
        router_args=tuple(shlex.split(args.router_args)),
    )
    described = ", ".join(f"{t.name} {t.rate:g}/s" for t in tenants)
    print(f"workload  tenants {described}, {duration:g} s")
    outdir = Path(args.output)
    outdir.mkdir(parents=True, exist_ok=True)
    document: dict[str, Any] = {
        "kvroute_version": __version__,
        "command": _command_line(),
        "workload": {"kind": "tenants", "duration_s": duration, "seed": args.seed},
        "targets": [],
        "failed": [],
    }
    answered = False
    for target in targets:
        try:
            with Stack(target, options) as stack:
                model = args.model or _model_of(stack.url)
                results = _run_async(
                    run_tenants(
                        stack.url,
                        tenants,
                        duration,
                        model=model,
                        timeout=args.timeout,
                        seed=args.seed,
                    )
                )
        except (TargetError, OSError, RuntimeError, TimeoutError) as exc:
            reason = str(exc).strip() or type(exc).__name__
            print(f"kvroute bench: target {target.name} failed: {reason}", file=sys.stderr)
            document["failed"].append({"name": target.name, "spec": target.spec, "reason": reason})
            continue
        rows = [summarize_tenant(t, results[t.name], duration) for t in tenants]
        answered = answered or any(r["ok"] for r in rows)
        print(f"\n{target.name} ({target.spec})\n{render_rows(rows)}")
        document["targets"].append({"name": target.name, "spec": target.spec, "tenants": rows})
    from router.bench import report

    report.write_json(outdir / "results.json", document)
    print(f"\nwrote {outdir / 'results.json'}")
    if not answered:
        print("kvroute bench: no target answered a request", file=sys.stderr)
        return 1
    return 0
