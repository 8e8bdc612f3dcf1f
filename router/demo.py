"""``make demo``: kvroute in front of four emulated engines, against round robin.

Starts four ``kvroute engine`` processes (KV events on ipc:// sockets in a temporary
directory) and a ``kvroute serve`` in front of them, all on loopback, each in its own
process group and always stopped on the way out. It sends a workload of groups of
prompts that share a 2,000-token prefix (a system prompt or a document each group asks
about) with eight requests in flight, prints what each engine served, then does the
same with ``--policy round_robin`` on freshly reset engines.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import urllib.request
from collections.abc import Sequence

from router.bench.loadgen import Summary, run_load, summarize
from router.policy import DEFAULT_POLICY
from router.process import EngineProcess, ServerProcess
from router.workloads.generated import shared_prefix_workload

ENGINES = 4
GROUPS, PER_GROUP, PREFIX, QUESTION, OUTPUT = 8, 8, 2_000, 40, 16
CONCURRENCY = 8


def _reset(url: str) -> None:
    request = urllib.request.Request(
        f"{url}/reset_prefix_cache", data=b"{}", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        response.read()


def _run(policy: str, engine_urls: Sequence[str]) -> Summary:
    for url in engine_urls:
        _reset(url)
    args = ["--port", "0", "--policy", policy, "--log-level", "warning"]
    for url in engine_urls:
        args += ["--engine", url]
    router = ServerProcess("serve", args)
    try:
        workload = shared_prefix_workload(GROUPS, PER_GROUP, PREFIX, QUESTION, OUTPUT, seed=1)
        results = asyncio.run(run_load(router.url, workload, concurrency=CONCURRENCY))
    finally:
        router.stop()
    return summarize(results)


def _table(policy: str, s: Summary) -> None:
    print(f"policy {policy}")
    print(f"  {'engine':<22}{'requests':>9}{'cached-token ratio':>20}")
    for engine, (count, ratio) in s.per_engine.items():
        print(f"  {engine:<22}{count:>9}{ratio:>20.2f}")
    print(
        f"  overall hit rate {s.hit_rate:.2f}   TTFT p50 {s.ttft_p50 * 1e3:.0f} ms, "
        f"p99 {s.ttft_p99 * 1e3:.0f} ms   requests of a group on its main engine "
        f"{s.group_affinity:.0%}   errors {s.errors}"
    )
    print()


def main(argv: Sequence[str] | None = None) -> int:
    # No options (make demo runs it as it is); --help says what it does.
    argparse.ArgumentParser(
        prog="python -m router.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args(argv)
    engines: list[EngineProcess] = []
    with tempfile.TemporaryDirectory(prefix="kvroute-demo-") as tmp:
        try:
            for i in range(ENGINES):
                engines.append(
                    EngineProcess(
                        [
                            "--port",
                            "0",
                            "--engine-id",
                            f"demo-{i}",
                            "--kv-events-endpoint",
                            f"ipc://{tmp}/engine{i}-events",
                            "--kv-events-replay-endpoint",
                            "tcp://127.0.0.1:*",
                        ]
                    )
                )
            urls = [e.url for e in engines]
            print(f"kvroute demo: {ENGINES} emulated engines ({', '.join(urls)})")
            print(
                f"workload: {GROUPS} groups x {PER_GROUP} requests sharing a {PREFIX:,}-token "
                f"prefix, {QUESTION}-token questions, {OUTPUT} output tokens, "
                f"{CONCURRENCY} in flight\n"
            )
            kv = _run(DEFAULT_POLICY, urls)
            _table(f"{DEFAULT_POLICY} (kvroute's default: cache affinity weighed against load)", kv)
            rr = _run("round_robin", urls)
            _table("round_robin (on freshly reset engines)", rr)
        finally:
            for engine in engines:
                engine.stop()
    gain = kv.hit_rate / rr.hit_rate if rr.hit_rate else float("inf")
    print(
        f"kvroute served {kv.hit_rate:.0%} of prompt tokens from cache, round robin "
        f"{rr.hit_rate:.0%} ({gain:.1f}x); TTFT p50 {kv.ttft_p50 * 1e3:.0f} ms vs "
        f"{rr.ttft_p50 * 1e3:.0f} ms."
    )
    failed = kv.errors + rr.errors
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
