"""What the router costs: added latency, throughput kept, CPU per request.

``python -m router.bench.overhead`` (part of ``make bench``) starts one emulated engine
with no artificial delay (``--time-scale 0.0001``) and ``kvroute serve`` in front of it,
each in its own process, then measures side by side in interleaved rounds, so drift on
a shared machine hits both paths alike:

* latency: small non-streaming completions, one at a time, router vs direct;
* throughput: the same requests with 32 in flight, router vs direct;
* the router process's CPU seconds (from /proc) per 1,000 requests it relayed.

Two placements: ``shared`` lets all three processes (load generator, engine, router)
share every core, as they must on a small machine; ``pinned`` puts the load generator
and the engine on CPU 0 and the router on CPU 1, so both paths give the engine the same
single core and the router a core of its own, as in a deployment. Prints a table and
writes ``bench-results/router.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import aiohttp

from router.process import EngineProcess, ServerProcess
from router.workloads.stats import percentile

BODY = json.dumps({"prompt": "how fast is the router " * 8, "max_tokens": 2}).encode()
HEADERS = {"Content-Type": "application/json"}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _burst(
    session: aiohttp.ClientSession, url: str, n: int, concurrency: int
) -> tuple[list[float], float]:
    latencies: list[float] = []
    remaining = iter(range(n))

    async def worker() -> None:
        for _ in remaining:
            t0 = time.perf_counter()
            async with session.post(url, data=BODY, headers=HEADERS) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{url} answered {resp.status}")
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - t0


async def measure(
    engine_url: str, router_url: str, router_pid: int, rounds: int, serial: int, parallel: int
) -> dict[str, Any]:
    targets = {"direct": f"{engine_url}/v1/completions", "router": f"{router_url}/v1/completions"}
    lat: dict[str, list[float]] = {k: [] for k in targets}
    rps: dict[str, list[float]] = {k: [] for k in targets}
    cpu = 0.0
    relayed = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for url in targets.values():
            await _burst(session, url, 200, 8)  # warm up connections and caches
        for _ in range(rounds):
            for name, url in targets.items():
                samples, _ = await _burst(session, url, serial, 1)
                lat[name] += samples
                before = cpu_seconds(router_pid) if name == "router" else 0.0
                _, elapsed = await _burst(session, url, parallel, 32)
                if name == "router":
                    cpu += cpu_seconds(router_pid) - before
                    relayed += parallel
                rps[name].append(parallel / elapsed)
    out: dict[str, Any] = {}
    for name in targets:
        out[name] = {
            "p50_ms": percentile(lat[name], 50) * 1e3,
            "p99_ms": percentile(lat[name], 99) * 1e3,
            "rps": sorted(rps[name])[len(rps[name]) // 2],
        }
    out["added_p50_ms"] = out["router"]["p50_ms"] - out["direct"]["p50_ms"]
    out["added_p99_ms"] = out["router"]["p99_ms"] - out["direct"]["p99_ms"]
    out["throughput_ratio"] = out["router"]["rps"] / out["direct"]["rps"]
    out["router_cpu_s_per_1000"] = cpu / relayed * 1000
    return out


def _place(placement: str, engine_pid: int, router_pid: int) -> None:
    if placement == "pinned":
        os.sched_setaffinity(0, {0})
        os.sched_setaffinity(engine_pid, {0})
        os.sched_setaffinity(router_pid, {1})
    else:
        every = set(range(os.cpu_count() or 1))
        for pid in (0, engine_pid, router_pid):
            os.sched_setaffinity(pid, every)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--serial", type=int, default=400, help="requests per latency round")
    parser.add_argument("--parallel", type=int, default=2000, help="requests per throughput round")
    parser.add_argument("--placement", choices=["shared", "pinned", "both"], default="both")
    parser.add_argument("--output", default="bench-results/router.json")
    args = parser.parse_args(argv)
    placements = ["shared", "pinned"] if args.placement == "both" else [args.placement]
    if "pinned" in placements and (os.cpu_count() or 1) < 2:
        placements.remove("pinned")
    engine = EngineProcess(["--port", "0", "--time-scale", "0.0001"])
    router = None
    results: dict[str, Any] = {}
    try:
        router = ServerProcess(
            "serve", ["--port", "0", "--engine", engine.url, "--log-level", "warning"]
        )
        for placement in placements:
            _place(placement, engine.proc.pid, router.proc.pid)
            results[placement] = asyncio.run(
                measure(
                    engine.url, router.url, router.proc.pid, args.rounds, args.serial, args.parallel
                )
            )
    finally:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        if router is not None:
            router.stop()
        engine.stop()
    print(f"{'placement':<10}{'path':<8}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>9}")
    for placement, res in results.items():
        for path in ("direct", "router"):
            r = res[path]
            print(f"{placement:<10}{path:<8}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}{r['rps']:>9.0f}")
    for placement, res in results.items():
        print(
            f"{placement}: router adds p50 {res['added_p50_ms']:.2f} ms, "
            f"p99 {res['added_p99_ms']:.2f} ms; keeps {res['throughput_ratio']:.0%} of direct "
            f"throughput; {res['router_cpu_s_per_1000']:.2f} CPU-s per 1,000 requests"
        )
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
