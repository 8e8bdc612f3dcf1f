"""``kvroute simulate``: replay a workload on a simulated fleet, one run per policy and fleet.

Examples::

    # the Mooncake conversation trace on 8 engines with Dynamo's mocker geometry
    kvroute simulate --trace mooncake-conversation --engines 8 --preset dynamo-mocker \\
        --policy kv_cost --policy round_robin --policy cache_aware_sglang

    # colocated vs disaggregated on the same 8 GPUs, unbounded caches
    kvroute simulate --trace mooncake-synthetic --fleet 8 --fleet 2P+6D --infinite-cache

    # a generated workload on 1,000 engines
    kvroute simulate --workload shared-prefix --groups 2000 --prompts-per-group 10 \\
        --engines 1000 --concurrency 2000

    # 1, 2 and 4 router replicas, their decisions reaching each other 0, 5 or 50 ms late
    kvroute simulate --trace mooncake-conversation --requests 2000 --engines 8 \\
        --preset dynamo-mocker --replicas 1,2,4 --sync-delay-ms 0,5,50

    # the latency policy at four weights of the inter-token latency it costs others
    kvroute simulate --trace mooncake-synthetic --engines 8 --preset dynamo-mocker \\
        --policy latency --sweep latency.itl_weight=0,0.05,0.1,0.2

Writes ``results.json`` and ``summary.md`` to ``--output`` (docs/simulator.md).
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import itertools
import json
import re
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from router import __version__
from router.config import Config, ConfigError, PolicyConfig, load_config
from router.engine_model import EngineParams
from router.engine_model.flags import add_model_arguments, engine_params
from router.policy import DEFAULT_POLICY, POLICY_NAMES
from router.sim import matrix
from router.sim.cluster import (
    LAYOUTS,
    REPLICA_PICKS,
    ClusterSim,
    Fleet,
    Layout,
    SimRun,
    SimSettings,
)
from router.sim.matrix import MATRIX
from router.workloads import tables as report
from router.workloads.flags import add_workload_arguments, build_workload
from router.workloads.spec import RequestSpec
from router.workloads.traces import TraceError

#: KV-cache capacity, in blocks, that ``--infinite-cache`` gives every engine. The block
#: cache keeps state only for blocks in use, so this costs nothing until used.
INFINITE_BLOCKS = 1 << 31

#: (label, key path, format, which way is better), as ``kvroute bench`` tables.
ROWS: list[tuple[str, str, str, str]] = [
    ("requests answered", "ok", "int", ""),
    ("refused by the engines", "errors", "int", "lower"),
    ("prefix-cache hit rate", "hit_rate", "pct", "higher"),
    ("ceiling (infinite cache, one engine)", "ceiling", "pct", ""),
    ("TTFT mean", "ttft_s.mean", "ms", "lower"),
    ("TTFT p50", "ttft_s.p50", "ms", "lower"),
    ("TTFT p99", "ttft_s.p99", "ms", "lower"),
    ("inter-token latency p50", "itl_s.p50", "ms", "lower"),
    ("inter-token latency p99", "itl_s.p99", "ms", "lower"),
    ("end-to-end p50", "e2e_s.p50", "s", "lower"),
    ("end-to-end p99", "e2e_s.p99", "s", "lower"),
    ("throughput, requests/s", "request_throughput", "num", "higher"),
    ("throughput, output tokens/s", "output_token_throughput", "num", "higher"),
    ("prefill load max/mean", "prefill_imbalance", "x", "lower"),
    ("requests max/mean", "request_imbalance", "x", "lower"),
    ("split share", "split_share", "pct", ""),
    ("splits crossing racks", "cross_rack_share", "pct", ""),
    ("preemptions", "preemptions", "int", "lower"),
    ("simulated time", "duration_s", "s", ""),
    ("wall time", "wall_s", "s", ""),
]

#: Rows of runs with several router replicas (docs/simulator.md, "Several router
#: replicas"), before the timing rows.
REPLICA_ROWS: list[tuple[str, str, str, str]] = [
    ("same-prefix pairs, two replicas", "replica_split.pairs_across", "int", ""),
    ("  on different engines (replica split rate)", "replica_split.across", "pct", "lower"),
    ("same-prefix pairs, one replica", "replica_split.pairs_within", "int", ""),
    ("  on different engines", "replica_split.within", "pct", ""),
]

#: The row of workloads with conversations (follow-up turns).
TURN_ROWS: list[tuple[str, str, str, str]] = [
    ("follow-up turns on the previous turn's engine", "turn_stickiness", "pct", "higher"),
]


def rows_for(summaries: Sequence[dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    """The table's rows: the replica rows when a run has several replicas, the turn row
    when the workload has follow-up turns."""
    extra: list[tuple[str, str, str, str]] = []
    if any(s["replicas"] > 1 for s in summaries):
        extra += REPLICA_ROWS
    if any(s["turn_stickiness"] is not None for s in summaries):
        extra += TURN_ROWS
    at = next(n for n, row in enumerate(ROWS) if row[1] == "duration_s")
    return [*ROWS[:at], *extra, *ROWS[at:]]


_FLEET = re.compile(r"^\s*(?:(\d+)|(\d+)\s*[Pp]\s*\+\s*(\d+)\s*[Dd])\s*$")


def parse_fleet(text: str) -> Fleet:
    """``8`` (colocated engines) or ``2P+6D`` (prefill + decode pools)."""
    match = _FLEET.match(text)
    if match is None:
        raise ValueError(f"fleet {text!r}: expected N (colocated) or PP+DD, e.g. 2P+6D")
    if match.group(1) is not None:
        return Fleet(engines=int(match.group(1)))
    return Fleet(prefill=int(match.group(2)), decode=int(match.group(3)))


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulated router: its configuration file and what the network adds."""
    group = parser.add_argument_group("router")
    group.add_argument(
        "--config",
        metavar="FILE",
        help="kvroute serve's YAML configuration: policy weights, disaggregation thresholds, "
        "scrape interval (docs/configuration.md)",
    )
    group.add_argument(
        "--event-lag-ms",
        type=float,
        default=5.0,
        help="milliseconds from an engine step to its KV events reaching the index",
    )
    group.add_argument(
        "--no-events",
        action="store_true",
        help="engines publish no KV events: the index knows only the router's decisions",
    )
    group.add_argument(
        "--slow-engines",
        type=_slow_engines,
        default=None,
        metavar="N:FACTOR",
        help="the first N engines run FACTOR times slower (every step): a throttled or "
        "older GPU, which only a router that times its engines (the latency policy) sees",
    )


def _slow_engines(text: str) -> tuple[int, float]:
    """``2:3`` -> (2, 3.0)."""
    count, sep, factor = text.partition(":")
    try:
        n, f = int(count), float(factor)
    except ValueError:
        n, f = -1, 0.0
    if not sep or n < 0 or not f > 0:
        raise argparse.ArgumentTypeError("--slow-engines: expected N:FACTOR, e.g. 2:3")
    return n, f


def _numbers(text: str, kind: type[int] | type[float], what: str) -> list[Any]:
    """``1,2,4``: the values of a flag that takes one or several."""
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}: expected comma-separated numbers") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{what}: expected one or more numbers >= 0")
    return values


def _replica_counts(text: str) -> list[int]:
    counts: list[int] = _numbers(text, int, "--replicas")
    if 0 in counts:
        raise argparse.ArgumentTypeError("--replicas: a fleet needs at least one replica")
    return counts


def _delays_ms(text: str) -> list[float]:
    delays: list[float] = _numbers(text, float, "--sync-delay-ms")
    return delays


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: expected a number above 0")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: expected a whole number above 0")
    return value


def _not_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text}: expected a number >= 0")
    return value


def add_replica_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Several router replicas in front of the fleet (docs/simulator.md, "Several router
    replicas")."""
    group = parser.add_argument_group("router replicas")
    group.add_argument(
        "--replicas",
        type=_replica_counts,
        default=[1],
        metavar="N[,N...]",
        help="route through N router replicas, each with its own index, load view and policy "
        "(several values: one run each; default 1)",
    )
    group.add_argument(
        "--sync-delay-ms",
        type=_delays_ms,
        default=[0.0],
        metavar="MS[,MS...]",
        help="milliseconds before a replica's decision records reach the other replicas (in "
        "the replicated index mode: index.replicated.sync_interval_s plus a Redis round trip; "
        "several values: one run each, side by side; default 0)",
    )
    group.add_argument(
        "--load-interval-ms",
        type=_positive,
        default=100.0,
        metavar="MS",
        help="milliseconds between the replicas' exchanges of in-flight load (default 100, "
        "as index.redis.load_interval_s)",
    )
    group.add_argument(
        "--load-push",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="between exchanges, each change of a replica's in-flight work on an engine "
        "reaches the others one sync delay later, as index.redis.load_push sends it on the "
        "decision stream (default on; --no-load-push: through the exchange alone)",
    )
    group.add_argument(
        "--replica-pick",
        choices=REPLICA_PICKS,
        default="random",
        help="which replica routes a request: random (by request id, as a Kubernetes "
        "Service) or round_robin",
    )
    group.add_argument(
        "--group-prefix-tokens",
        type=_positive_int,
        default=1_024,
        metavar="T",
        help="replica split rate: requests whose first T tokens match form a prefix group",
    )
    group.add_argument(
        "--burst-window-ms",
        type=_not_negative,
        default=1_000.0,
        metavar="MS",
        help="replica split rate: pair requests of a prefix group at most MS apart",
    )
    return group


def replica_variants(args: argparse.Namespace) -> list[tuple[int, float]]:
    """(replicas, sync delay in seconds) of each run the flags ask for; one replica has
    nothing to sync, so it runs once."""
    variants: list[tuple[int, float]] = []
    for count in getattr(args, "replicas", [1]):
        for delay_ms in getattr(args, "sync_delay_ms", [0.0]) if count > 1 else [0.0]:
            if (count, delay_ms / 1e3) not in variants:
                variants.append((count, delay_ms / 1e3))
    return variants


#: One ``--sweep``: the key as written (without ``policy.``), its path in the ``policy``
#: section, and each value as written with its YAML reading.
Sweep = tuple[str, tuple[str, ...], list[tuple[str, Any]]]


def _sweep(text: str) -> Sweep:
    """``KEY=V1,V2,...``: a key of the ``policy`` section (dotted, optionally
    ``policy.``-prefixed) and its values, each read as a YAML scalar."""
    written_key, sep, listed = text.partition("=")
    path = tuple(part.strip() for part in written_key.split("."))
    if path[:1] == ("policy",) and len(path) > 1:
        path = path[1:]
    key = ".".join(path)
    if not sep or not all(path):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected KEY=V1,V2,... (e.g. decode_weight=0,0.5)"
        )
    values: list[tuple[str, Any]] = []
    for part in listed.split(","):
        written = part.strip()
        if not written:
            raise argparse.ArgumentTypeError(f"{text!r}: an empty value (expected KEY=V1,V2,...)")
        try:
            value = yaml.safe_load(written)
        except yaml.YAMLError:
            value = written
        if isinstance(value, list | dict):
            raise argparse.ArgumentTypeError(f"{text!r}: {written!r} is not a single value")
        if any(written == other for other, _ in values):
            raise argparse.ArgumentTypeError(f"{text!r}: {written!r} is listed twice")
        values.append((written, value))
    return key, path, values


def _policy_error(exc: ValidationError) -> str:
    """Every error of a swept policy section, each naming its key."""
    lines: list[str] = []
    for err in exc.errors():
        loc = [str(part) for part in err["loc"]]
        if err["type"] == "extra_forbidden":  # an unknown key: the closest known one
            section: Any = PolicyConfig
            for part in loc[:-1]:
                field = getattr(section, "model_fields", {}).get(part)
                section = None if field is None else field.annotation
            known = list(getattr(section, "model_fields", {}))
            close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.7)
            detail = f"; did you mean {close[0]}?" if close else ""
        else:
            detail = f" (got {err['input']!r})"
        lines.append(f"policy.{'.'.join(loc)}: {err['msg']}{detail}")
    return "; ".join(lines)


def policy_variants(
    policy: PolicyConfig, sweeps: Sequence[Sweep]
) -> list[tuple[str, PolicyConfig, dict[str, Any]]]:
    """The cross product of ``sweeps`` over ``policy``, in flag order: each variant's
    label (`` key=value`` per swept key, the value as written), its policy section
    (validated) and the swept values as validated. Raises ValueError naming a bad key
    or value."""
    seen: set[tuple[str, ...]] = set()
    for key, path, _ in sweeps:
        if path == ("name",):
            raise ValueError("--sweep name: choose policies with --policy")
        if path in seen:
            raise ValueError(f"--sweep {key}: the key is swept twice")
        seen.add(path)
    variants: list[tuple[str, PolicyConfig, dict[str, Any]]] = []
    for combination in itertools.product(*(values for _, _, values in sweeps)):
        data = policy.model_dump()
        label = ""
        for (key, path, _), (written, value) in zip(sweeps, combination, strict=True):
            node = data
            for depth, part in enumerate(path[:-1]):
                child = node.setdefault(part, {})
                if not isinstance(child, dict):
                    where = ".".join(path[: depth + 1])
                    raise ValueError(f"--sweep {key}: policy.{where} is a value, not a section")
                node = child
            node[path[-1]] = value
            label += f" {key}={written}"
        try:
            variant = PolicyConfig.model_validate(data)
        except ValidationError as exc:
            raise ValueError(f"--sweep: {_policy_error(exc)}") from None
        swept: dict[str, Any] = {}
        for key, path, _ in sweeps:
            node = variant.model_dump()
            for part in path:
                node = node[part]
            swept[key] = node
        variants.append((label, variant, swept))
    return variants


def add_layout_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Racks and where the engines sit on them (the router knows it, as
    ``engines[].topology``; docs/simulator.md, "Racks and links")."""
    group = parser.add_argument_group("racks and links")
    group.add_argument(
        "--racks",
        type=int,
        metavar="R",
        help="engines sit on R racks of one zone, one engine per node (default: no topology, "
        "one flat link)",
    )
    group.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="packed",
        help="packed: each rack holds its share of both pools; spread: engines fill the racks "
        "in order, prefill pool first",
    )
    group.add_argument(
        "--rack-uplink-gb-s",
        type=float,
        default=25.0,
        metavar="GB_S",
        help="capacity of each rack's uplink, shared by the transfers leaving or entering it",
    )
    return group


def layout_of(args: argparse.Namespace, style: str | None = None) -> Layout | None:
    """The layout the flags name (``style`` overrides ``--layout``); None without
    ``--racks``."""
    if args.racks is None:
        return None
    return Layout(args.racks, style or args.layout, args.rack_uplink_gb_s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``kvroute simulate`` (docs/simulator.md describes each)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1] if __doc__ else None
    fleet = parser.add_argument_group("fleet and policies")
    fleet.add_argument("--engines", type=int, metavar="N", help="N colocated engines")
    fleet.add_argument("--prefill", type=int, metavar="P", help="P prefill engines")
    fleet.add_argument("--decode", type=int, metavar="D", help="D decode engines")
    fleet.add_argument(
        "--fleet",
        action="append",
        default=[],
        metavar="SPEC",
        help="a fleet, N or PP+DD (repeatable, for side-by-side fleets; default: 8)",
    )
    fleet.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="NAME",
        help=f"routing policy (repeatable; 'all' = every one): {', '.join(POLICY_NAMES)} "
        f"(default: {DEFAULT_POLICY})",
    )
    fleet.add_argument(
        "--sweep",
        action="append",
        type=_sweep,
        default=[],
        metavar="KEY=V1,V2,...",
        help="run each policy once per value of KEY, a dotted key of the configuration's "
        "policy section (decode_weight, latency.itl_weight; a leading 'policy.' is optional), "
        "the rest of the section as --config sets it; values are YAML scalars (numbers, "
        "strings, true/false, null); repeatable: several --sweep flags run their cross "
        "product; runs are named 'POLICY KEY=VALUE ...' and results.json gives each run's "
        "swept values as 'sweep'",
    )
    fleet.add_argument("--baseline", metavar="NAME", help="run the ratios divide by (first)")
    fleet.add_argument(
        "--matrix",
        nargs="*",
        metavar="NAME",
        help="run the workload matrix a routing change is judged on (every workload, or "
        "those named: " + ", ".join(e.name for e in MATRIX) + ") with the default policy "
        "beside round_robin, least_loaded, cache_aware_sglang and kv_cost (or the --policy "
        "flags, the first judged), as one table and the rule the default is held to; the "
        "workload, fleet and engine flags are the matrix's own (docs/simulator.md)",
    )
    add_model_arguments(parser).add_argument(
        "--infinite-cache",
        action="store_true",
        help="every engine's KV cache is unbounded (no eviction)",
    )
    add_router_arguments(parser)
    add_replica_arguments(parser)
    add_layout_arguments(parser)
    add_workload_arguments(parser, trace_alias=True, prompt_format="tokens")
    out = parser.add_argument_group("output")
    out.add_argument(
        "--output", default="bench-results/simulate", metavar="DIR", help="where files go"
    )
    out.add_argument("--quiet", action="store_true", help="no line per finished run")


def fleets_of(args: argparse.Namespace) -> list[Fleet]:
    """The fleets the flags name, in order."""
    fleets = [parse_fleet(text) for text in args.fleet]
    if args.engines is not None:
        fleets.append(Fleet(engines=args.engines))
    if args.prefill is not None or args.decode is not None:
        fleets.append(Fleet(prefill=args.prefill or 0, decode=args.decode or 0))
    return fleets or [Fleet(engines=8)]


def policies_of(args: argparse.Namespace) -> list[str]:
    names: list[str] = []
    for name in args.policy or [DEFAULT_POLICY]:
        for one in POLICY_NAMES if name == "all" else [name]:
            one = DEFAULT_POLICY if one == "default" else one
            if one not in POLICY_NAMES:
                raise ValueError(f"unknown policy {one!r}; choose one of {', '.join(POLICY_NAMES)}")
            if one not in names:
                names.append(one)
    return names


def model_params(args: argparse.Namespace) -> EngineParams:
    params = engine_params(args)
    if args.infinite_cache:
        params = params.replace(num_gpu_blocks=INFINITE_BLOCKS)
    return params


def settings_for(
    fleet: Fleet,
    policy: str,
    params: EngineParams,
    config: Config,
    args: argparse.Namespace,
    concurrency: int,
    layout: Layout | None = None,
    replicas: int = 1,
    sync_delay_s: float = 0.0,
) -> SimSettings:
    """One run's settings: the router configuration with ``policy`` in it; ``layout``
    (default: the flags') places a disaggregated fleet on racks; ``replicas`` router
    replicas whose decisions reach each other ``sync_delay_s`` late (the other replica
    flags, where the command has them, say how they share load and how the replica
    split rate groups requests)."""
    if layout is None and fleet.disaggregated and getattr(args, "racks", None) is not None:
        layout = layout_of(args)
    shared: dict[str, Any] = {}
    if hasattr(args, "load_interval_ms"):
        shared = {
            "load_interval_s": args.load_interval_ms / 1e3,
            "load_push": args.load_push,
            "replica_pick": args.replica_pick,
            "group_prefix_tokens": args.group_prefix_tokens,
            "burst_window_s": args.burst_window_ms / 1e3,
        }
    slow = getattr(args, "slow_engines", None) or (0, 1.0)
    return SimSettings(
        fleet=fleet,
        params=params,
        policy=config.policy.model_copy(update={"name": policy}),
        disaggregation=config.disaggregation,
        event_lag_s=args.event_lag_ms / 1e3,
        events=not args.no_events,
        scrape_interval_s=config.scrape.interval_s,
        concurrency=concurrency,
        duration_s=args.duration,
        layout=layout,
        replicas=replicas,
        sync_delay_s=sync_delay_s,
        slow_engines=slow[0],
        slowdown=slow[1],
        **shared,
    )


def replica_label(replicas: int, sync_delay_s: float) -> str:
    """The part of a run's name that says its replicas: `` x1``, `` x2 sync=5ms``."""
    if replicas == 1:
        return " x1"
    return f" x{replicas} sync={sync_delay_s * 1e3:g}ms"


def simulate(settings: SimSettings, specs: Sequence[RequestSpec], name: str) -> SimRun:
    """Run one simulation to the end; the specs are not consumed."""
    started = time.perf_counter()
    run = asyncio.run(ClusterSim(settings, name).run(list(specs)))
    run.wall_s = time.perf_counter() - started - run.measure_s
    return run


def run_entry(entry: matrix.Entry, policy: str, config: str | None = None) -> dict[str, Any]:
    """One policy on one workload of the matrix: the run's summary, as ``kvroute simulate``
    with the workload's flags and ``--config`` would report it."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(shlex.split(entry.flags))
    loaded = load_config(config)
    workload = build_workload(args, compact=True)
    settings = settings_for(
        fleets_of(args)[0], policy, model_params(args), loaded, args, workload.concurrency
    )
    summary = simulate(settings, workload.specs, policy).summary()
    summary["workload"] = entry.name
    return summary


def run(args: argparse.Namespace) -> int:
    """Entry point of ``kvroute simulate``."""
    if args.matrix is not None:
        return matrix.run(args, run_entry)
    try:
        fleets = fleets_of(args)
        policies = policies_of(args)
        params = model_params(args)
        config = load_config(args.config)
        workload = build_workload(args, compact=True)
        layout = layout_of(args)
        sweeps: list[Sweep] = getattr(args, "sweep", [])
        swept = policy_variants(config.policy, sweeps) if sweeps else None
    except (ConfigError, TraceError, ValueError, FileNotFoundError) as exc:
        print(f"kvroute simulate: {exc}", file=sys.stderr)
        return 2
    several = len(fleets) > 1
    variants = replica_variants(args)
    replicated = variants != [(1, 0.0)]
    # Without --sweep, one variant: the configuration's own policy section, unlabelled.
    policy_sections = swept or [("", config.policy, {})]
    plan = [
        (fleet, policy, count, delay, section)
        for fleet in fleets
        for policy in policies
        for section in policy_sections
        for count, delay in variants
    ]
    names = [
        (f"{policy}@{fleet.describe()}" if several else policy)
        + (replica_label(count, delay) if replicated else "")
        + label
        for fleet, policy, count, delay, (label, _, _) in plan
    ]
    baseline = args.baseline or names[0]
    if baseline not in names:
        print(f"kvroute simulate: --baseline {baseline} is not one of {', '.join(names)}")
        return 2
    cache = "unbounded" if args.infinite_cache else f"{params.num_gpu_blocks:,} blocks"
    print(f"workload  {workload.description}")
    print(
        f"engines   {args.preset}: block {params.block_size}, cache {cache}, "
        f"{params.max_num_batched_tokens:,} batched tokens, {params.max_num_seqs} sequences"
    )
    if layout is not None:
        print(f"racks     {layout.describe()}")
    if replicated:
        print(
            f"replicas  {args.replica_pick} pick, in-flight load exchanged every "
            f"{args.load_interval_ms:g} ms"
            f"{' and its changes sent at once' if args.load_push else ''}; "
            f"prefix groups of {args.group_prefix_tokens:,} "
            f"tokens, pairs at most {args.burst_window_ms:g} ms apart"
        )
    print(f"runs      {', '.join(names)}\n")
    summaries = []
    for (fleet, policy, count, delay, (_, section, values)), name in zip(plan, names, strict=True):
        settings = settings_for(
            fleet,
            policy,
            params,
            config if swept is None else config.model_copy(update={"policy": section}),
            args,
            workload.concurrency,
            replicas=count,
            sync_delay_s=delay,
        )
        result = simulate(settings, workload.specs, name)
        summary = result.summary()
        if swept is not None:  # the swept values, after the policy's name
            at = list(summary).index("policy") + 1
            items = list(summary.items())
            summary = dict([*items[:at], ("sweep", values), *items[at:]])
        summaries.append(summary)
        if not args.quiet:
            memory = summary["router_index"]
            per_entry = memory["bytes_per_entry"]
            print(
                f"  {name}: {summary['ok']:,} requests, {summary['duration_s']:,.0f} s simulated "
                f"in {result.wall_s:.1f} s; router index at the end {memory['entries']:,} "
                f"entries ({memory['expiring']:,} provisional), "
                f"{memory['bytes'] / 2**20:,.1f} MiB"
                + (f" ({per_entry:.0f} B/entry)" if per_entry else ""),
                flush=True,
            )
    oracle = workload.info.get("oracle_block_hit_rate")
    rows = report.table_rows(summaries, baseline, rows_for(summaries))
    print()
    print(report.render_text(rows, keep=report.LABEL_COLUMNS))
    if oracle is not None:
        print(f"\ntrace block oracle (blocks repeating an earlier block): {oracle:.1%}")
    floor = summaries[0].get("floor") if summaries else None
    if floor and floor.get("ttft_p99_s") is not None:
        itl = floor.get("itl_p99_s")
        print(
            "floor for any router on the first run's requests (each prompt's own prefill "
            "alone on an idle engine, every block an earlier request computed served from "
            "cache; each token a decode step of its sequence alone): "
            f"TTFT mean {floor['ttft_mean_s'] * 1e3:,.1f} ms, "
            f"p99 {floor['ttft_p99_s'] * 1e3:,.1f} ms"
            + (f"; inter-token p99 {itl * 1e3:,.2f} ms" if itl is not None else "")
        )
    document: dict[str, Any] = {
        "kvroute_version": __version__,
        "command": " ".join(["kvroute", *sys.argv[1:]]) if sys.argv[1:2] == ["simulate"] else None,
        "workload": {"description": workload.description, **workload.info},
        "engine_params": params.__dict__,
        "baseline": baseline,
        "runs": summaries,
    }
    outdir = Path(args.output)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "results.json").write_text(json.dumps(document, indent=1, default=str) + "\n")
    (outdir / "summary.md").write_text(
        f"{workload.description}\n\n{report.render_markdown(rows)}\n"
    )
    print(f"\nwrote {outdir / 'results.json'}, {outdir / 'summary.md'}")
    return 0
