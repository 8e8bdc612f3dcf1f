"""``make bench-compare``: kvroute against round robin and the routers users know.

Every target gets 4 fresh emulated engines (prefill cost doubled so the shortened
prompts still load them; KV events on TCP, vLLM's empty topic and the ``v2-mixed`` shape
so that every router, vllm-router's ``kv_aware`` included, can read them) and the same
two workloads: a reduced Mooncake conversation replay and a multi-turn chat with a
shared system prompt. Targets:

* ``kvroute``: ``kvroute serve`` with its default policy (``latency``: each placement's
  cost to everyone, in seconds of the engines' measured speed);
* ``kv_cost``: ``kvroute serve --policy kv_cost`` (the previous default);
* ``rr``: ``kvroute serve --policy round_robin`` (the baseline of every ratio);
* ``sglang_ca``: kvroute's re-implementation of sglang-router's ``cache_aware``;
* ``sglang``, ``vllm_ca``, ``vllm_kv``: the real sglang-router (cache_aware) and
  vllm-router (cache_aware, and kv_aware fed with the engines' KV events), installed
  from PyPI into ``build/compat`` (``make compat`` does the same); skipped, with the
  reason, when they cannot be installed.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from router.emulator.compat import install
from router.emulator.config import DEFAULT_MODEL

BUILD = Path("build/compat")
#: KV events on TCP (vllm-router is another process), on vLLM's default topic ("") and in
#: the one payload shape vllm-router 0.1.17 decodes (an array batch of tagged-map events,
#: ``v2-mixed``): its static sources drop messages on any other topic and reject the rest.
ENGINE_ARGS = (
    "--prefill-us-per-token 100 --kv-events-endpoint tcp://127.0.0.1:* "
    "--kv-events-topic '' --kv-events-format v2-mixed"
)
COMMON = "--host {host} --port {port} --prometheus-host 127.0.0.1 --prometheus-port {free_port}"


def targets() -> list[str]:
    """The ``NAME=SPEC`` of every target, installing the peer routers first (a peer that
    cannot be installed is left out, with the reason on stderr)."""
    found = [
        "kvroute=policy:default",
        "kv_cost=policy:kv_cost",
        "rr=policy:round_robin",
        "sglang_ca=policy:cache_aware_sglang",
    ]
    sglang, why = install(BUILD, "sglang-router")
    if sglang is not None:
        found.append(
            f"sglang=cmd:{sglang} launch {COMMON} --policy cache_aware --worker-urls {{engines}}"
        )
    else:
        print(f"bench-compare: no sglang-router ({why})", file=sys.stderr)
    vllm, why = install(BUILD, "vllm-router")
    if vllm is not None:
        found.append(f"vllm_ca=cmd:{vllm} {COMMON} --policy cache_aware --worker-urls {{engines}}")
        found.append(
            f"vllm_kv=cmd:{vllm} {COMMON} --policy kv_aware --worker-urls {{engines}} "
            "{each:--kv-event-source:kv_event_sources} "
            "{each:--kv-event-replay-source:kv_event_replay_sources} "
            f"--kv-event-block-size 16 --kv-event-model {DEFAULT_MODEL}"
        )
    else:
        print(f"bench-compare: no vllm-router ({why})", file=sys.stderr)
    return found


#: The two workloads, each run against every target.
RUNS = [
    [
        "--workload",
        "mooncake-conversation",
        "--requests",
        "1500",
        "--speedup",
        "8",
        "--scale",
        "0.0625",
        "--max-output-tokens",
        "128",
        "--output",
        "bench-results/compare-mooncake",
    ],
    [
        "--workload",
        "chat",
        "--conversations",
        "64",
        "--turns",
        "6",
        "--system-tokens",
        "1000",
        "--question-tokens",
        "200",
        "--output-tokens",
        "100",
        # Answers of varied length (+-50%): with all answers alike, conversations that start
        # together stay in step for ever, which no real traffic does (docs/simulator.md,
        # "The workload matrix").
        "--output-spread",
        "0.5",
        "--concurrency",
        "16",
        "--output",
        "bench-results/compare-chat",
    ],
]


def bench_argvs(found: list[str]) -> list[list[str]]:
    """The ``kvroute bench`` arguments of each run, given the targets found."""
    base = [
        "--engines",
        "4",
        "--model",
        DEFAULT_MODEL,
        "--engine-args",
        ENGINE_ARGS,
        "--baseline",
        "rr",
        # Two interleaved rounds (the second in reverse order): a machine that slows down
        # over the run weighs on every target alike, and each number is a median of two.
        "--rounds",
        "2",
        "--compare",
        *found,
    ]
    return [[*base, *run] for run in RUNS]


def main(argv: list[str] | None = None) -> int:
    # No options: the runs are fixed (docs/benchmarks.md); --help says what it does.
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args(argv)
    BUILD.mkdir(parents=True, exist_ok=True)
    status = 0
    for argv in bench_argvs(targets()):
        # The exact command, for docs/benchmarks.md (results.json records it too).
        print(f"bench-compare: {shlex.join(['.venv/bin/kvroute', 'bench', *argv])}\n")
        status |= _bench(argv)
    return status


def _bench(argv: list[str]) -> int:
    from router.cli import main as kvroute

    return kvroute(["bench", *argv])


if __name__ == "__main__":
    sys.exit(main())
