"""``kvroute simulate --matrix``: the workload matrix a routing change is judged on.

Common shapes of traffic, each a ``kvroute simulate`` command (so any row can be run
and looked at on its own), run with the default policy beside round robin,
least-loaded, ``cache_aware_sglang`` (sglang-router's rule) and ``kv_cost`` (the previous
default), printed as one table. Under it, the rule every row is held to: the default no
worse than the better of round robin and least-loaded, 3% of slack, on TTFT mean,
TTFT p99, inter-token p99, end-to-end p99 and throughput, and a prefix-cache hit rate
at least theirs. The simulator is deterministic, so the table is the same on every
machine; ``tests/unit/test_sim_matrix.py`` holds the rule on the rows it can run fast.

Closed loops send each conversation's next turn the moment its answer ends; answers of
one length keep requests that start together in step for ever, which no real traffic
does and which makes the rare long stall of a load balancer look like no stall at all at
the 99th percentile. So the generated rows draw answers within +-50% of their length
(``--output-spread 0.5``), except the ``kvroute bench --help`` example, which is as
its help gives it (docs/simulator.md, "The workload matrix").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router import __version__
from router.policy import DEFAULT_POLICY
from router.workloads import tables as report

#: The slack of the rule: a row holds at up to 3% worse than the better of the two.
SLACK = 0.03


@dataclass(frozen=True)
class Entry:
    """One workload of the matrix."""

    name: str
    what: str
    flags: str
    """Its ``kvroute simulate`` flags (workload, fleet, engine model)."""


MATRIX: tuple[Entry, ...] = (
    Entry(
        "help-chat",
        "the `kvroute bench --help` chat example",
        "--workload chat --conversations 24 --turns 4 --engines 4",
    ),
    Entry(
        "system-prompt",
        "many conversations sharing a long system prompt at high concurrency",
        "--workload chat --conversations 48 --turns 5 --system-tokens 1500 "
        "--output-spread 0.5 --concurrency 24 --engines 8",
    ),
    Entry(
        "system-prompt-8",
        "8 conversations in flight on 8 engines sharing a 2,000-token system prompt",
        "--workload chat --conversations 32 --turns 4 --system-tokens 2000 "
        "--output-spread 0.5 --concurrency 8 --engines 8",
    ),
    Entry(
        "chat-think",
        "multi-turn chat with answers of varied length and think time",
        "--workload chat --conversations 64 --turns 6 --output-spread 0.5 --think-time 2 "
        "--concurrency 32 --engines 4",
    ),
    Entry(
        "compare-chat",
        "make bench-compare's chat (1,000-token system prompt, 200-token questions)",
        "--workload chat --conversations 64 --turns 6 --system-tokens 1000 "
        "--question-tokens 200 --output-tokens 100 --output-spread 0.5 --concurrency 16 "
        "--engines 4 --prefill-us-per-token 100",
    ),
    Entry(
        "groups",
        "shared-prefix groups: 64 groups of 16 prompts on 16 engines",
        "--workload shared-prefix --groups 64 --prompts-per-group 16 --prefix-tokens 2000 "
        "--output-spread 0.5 --concurrency 64 --engines 16",
    ),
    Entry(
        "mooncake",
        "make bench-compare's Mooncake conversation replay",
        "--trace mooncake-conversation --requests 1500 --speedup 8 --scale 0.0625 "
        "--max-output-tokens 128 --engines 4 --prefill-us-per-token 100",
    ),
    Entry(
        "azure-code",
        "no reuse at all: the Azure code trace",
        "--trace azure-code --requests 2000 --engines 4",
    ),
    Entry(
        "samples",
        "the same prompt n times at once (reinforcement-learning rollouts)",
        "--workload samples --groups 32 --prompts-per-group 8 --prefix-tokens 1000 "
        "--output-tokens 256 --output-spread 0.5 --concurrency 32 --engines 4",
    ),
    Entry(
        "long-docs",
        "long prompts: 8,000-token shared documents, 200-token questions",
        "--workload shared-prefix --groups 24 --prompts-per-group 8 --prefix-tokens 8000 "
        "--question-tokens 200 --output-tokens 128 --output-spread 0.5 --concurrency 32 "
        "--engines 8",
    ),
)

#: The policies of every row: the default first, then those it is compared with.
POLICIES: tuple[str, ...] = (
    DEFAULT_POLICY,
    "round_robin",
    "least_loaded",
    "cache_aware_sglang",
    "kv_cost",
)
#: The balancers the rule holds the default to.
BALANCERS = ("round_robin", "least_loaded")

#: (label, key path, format, which way is better) of each row the rule judges.
METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("hit rate", "hit_rate", "pct", "higher"),
    ("TTFT mean", "ttft_s.mean", "ms", "lower"),
    ("TTFT p99", "ttft_s.p99", "ms", "lower"),
    ("ITL p99", "itl_s.p99", "ms", "lower"),
    ("e2e p99", "e2e_s.p99", "s", "lower"),
    ("requests/s", "request_throughput", "num", "higher"),
)


@dataclass(frozen=True)
class Verdict:
    """How the default did on one metric of one workload against the balancers."""

    metric: str
    holds: bool
    default: float
    bound: float
    """The value it had to reach: the better balancer's, with the slack."""


def entry(name: str) -> Entry:
    """The matrix's workload called ``name``."""
    for one in MATRIX:
        if one.name == name:
            return one
    known = ", ".join(e.name for e in MATRIX)
    raise ValueError(f"no workload {name!r} in the matrix; one of {known}")


def judge(runs: dict[str, dict[str, Any]], default: str = DEFAULT_POLICY) -> list[Verdict]:
    """The rule on one workload's runs (policy name -> summary)."""
    verdicts = []
    for label, path, _, better in METRICS:
        mine = report.lookup(runs[default], path)
        theirs = [report.lookup(runs[b], path) for b in BALANCERS]
        known = [v for v in theirs if v is not None]
        if mine is None or not known:
            continue
        if better == "higher":
            best = max(known)
            # A hit rate at least theirs; throughput within the slack.
            bound = best if path == "hit_rate" else best * (1 - SLACK)
            holds = mine >= bound - 1e-12
        else:
            bound = min(known) * (1 + SLACK)
            holds = mine <= bound + 1e-12
        verdicts.append(Verdict(label, holds, mine, bound))
    return verdicts


Results = dict[str, dict[str, dict[str, Any]]]
"""Workload name -> policy name -> the run's summary."""


def table(results: Results, policies: Sequence[str]) -> list[list[str]]:
    """Header and rows: per workload and metric, each policy's value and the rule."""
    default = policies[0]
    rows = [["workload", "metric", *policies, "rule"]]
    for name, runs in results.items():
        verdicts = {v.metric: v for v in judge(runs, default)}
        for n, (label, path, kind, _) in enumerate(METRICS):
            cells = [report.fmt(report.lookup(runs[p], path), kind) for p in policies]
            verdict = verdicts.get(label)
            rule = "" if verdict is None else ("ok" if verdict.holds else "LOSES")
            rows.append([name if n == 0 else "", label, *cells, rule])
    return rows


#: Runs one policy on one workload and returns the run's summary (``router.sim.cli``'s
#: ``run_entry``, a module-level function so that worker processes can run it).
RunEntry = Callable[[Entry, str, str | None], dict[str, Any]]


def run(args: argparse.Namespace, run_entry: RunEntry) -> int:
    """``kvroute simulate --matrix [NAME ...]``: every workload (or those named) with every
    policy of :data:`POLICIES` (or ``--policy``, the first being the one judged), each
    run by ``run_entry``."""
    try:
        chosen = [entry(n) for n in args.matrix] if args.matrix else list(MATRIX)
        policies = list(dict.fromkeys(args.policy or POLICIES))
        policies = [DEFAULT_POLICY if p == "default" else p for p in policies]
        for balancer in BALANCERS:
            if balancer not in policies:
                policies.append(balancer)
    except ValueError as exc:
        print(f"kvroute simulate: {exc}", file=sys.stderr)
        return 2
    for one in chosen:
        print(f"{one.name:<16} {one.what}\n{'':<16} kvroute simulate {one.flags}")
    jobs = [(one, policy, args.config) for one in chosen for policy in policies]
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers) as pool:
        summaries = list(pool.map(run_entry, *zip(*jobs, strict=True)))
    results: Results = {}
    for (one, policy, _), summary in zip(jobs, summaries, strict=True):
        results.setdefault(one.name, {})[policy] = summary
    rows = table(results, policies)
    print()
    print(report.render_text(rows))
    judged = [v for runs in results.values() for v in judge(runs, policies[0])]
    held = sum(v.holds for v in judged)
    print(
        f"\nrule: {policies[0]} no worse than the better of {' and '.join(BALANCERS)} "
        f"({SLACK:.0%} slack; hit rate at least theirs): {held} of {len(judged)} rows hold"
    )
    document = {
        "kvroute_version": __version__,
        "policies": policies,
        "slack": SLACK,
        "workloads": [
            {
                "name": one.name,
                "what": one.what,
                "command": f"kvroute simulate {one.flags}",
                "runs": results[one.name],
                "rule": [v.__dict__ for v in judge(results[one.name], policies[0])],
            }
            for one in chosen
        ],
    }
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(document, indent=1, default=str) + "\n")
    (out / "summary.md").write_text(report.render_markdown(rows) + "\n")
    print(f"\nwrote {out / 'results.json'}, {out / 'summary.md'}")
    return 0
