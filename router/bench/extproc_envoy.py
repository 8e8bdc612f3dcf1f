"""What kvroute adds as an Envoy gateway's endpoint picker (ext_proc), through a real Envoy.

``python -m router.bench.extproc_envoy`` (``make bench-grpc``) starts two emulated
engines with no artificial delay (``--time-scale 0.0001``), ``kvroute serve
--extproc-port 0`` in front of them, and two Envoys (the ``make envoy`` binary, one
worker thread each) configured as the Gateway API Inference Extension's reference
gateway: one with kvroute's ext_proc picker (FULL_DUPLEX_STREAMED bodies, an
ORIGINAL_DST cluster that follows ``x-gateway-destination-endpoint``), the other with the
same listener and a round-robin cluster of the engines and no picker. Then, in interleaved
rounds, non-streamed completions one at a time (40-token and 8,192-token prompts) to:

* the engines directly (alternating);
* plain Envoy: what a gateway costs without a picker;
* Envoy + kvroute's ext_proc: the picker's added latency is its p50 minus plain Envoy's;
* kvroute's own HTTP API, for comparison;

with kvroute's CPU per request on the ext_proc path (from ``/proc``). Prints a table and
writes ``bench-results/extproc_envoy.json``; without an Envoy binary it says so and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from typing import Any

import aiohttp

from router.bench.gateway import Envoy, find_envoy
from router.bench.peers import WORKLOADS, fast_engines, group_cpu_seconds, use_uvloop
from router.bench.report import save_results
from router.process import ServerProcess
from router.workloads.stats import percentile

HEADERS = {"Content-Type": "application/json"}


async def _healthy(envoy: Envoy, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(envoy.extproc_healthy):
        if time.monotonic() > deadline:
            raise TimeoutError(f"Envoy never saw the ext_proc server healthy: {envoy.output()}")
        await asyncio.sleep(0.1)


async def measure(
    targets: dict[str, list[str]], router_pid: int, workload: str, rounds: int, per_round: int
) -> dict[str, Any]:
    bodies = WORKLOADS[workload]()
    latency: dict[str, list[float]] = {name: [] for name in targets}
    cpu = 0.0
    picked = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def run(urls: list[str], n: int) -> list[float]:
            samples = []
            turn = itertools.cycle(urls)
            for _ in range(n):
                url, body = next(turn), next(bodies)
                t0 = time.perf_counter()
                async with session.post(url, data=body, headers=HEADERS) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"{url} answered {resp.status}: {await resp.text()}")
                samples.append(time.perf_counter() - t0)
            return samples

        for urls in targets.values():
            await run(urls, max(per_round // 4, 10))  # warm connections and caches
        names = list(targets)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                before = group_cpu_seconds(router_pid)
                latency[name] += await run(targets[name], per_round)
                if name == "envoy+extproc":
                    cpu += group_cpu_seconds(router_pid) - before
                    picked += per_round
    out: dict[str, Any] = {
        name: {
            "p50_ms": percentile(samples, 50) * 1e3,
            "p99_ms": percentile(samples, 99) * 1e3,
            "n": len(samples),
        }
        for name, samples in latency.items()
    }
    plain = out["envoy"]
    out["picker_added_p50_ms"] = out["envoy+extproc"]["p50_ms"] - plain["p50_ms"]
    out["picker_added_p99_ms"] = out["envoy+extproc"]["p99_ms"] - plain["p99_ms"]
    out["envoy_added_p50_ms"] = plain["p50_ms"] - out["direct"]["p50_ms"]
    out["kvroute_http_added_p50_ms"] = out["kvroute HTTP"]["p50_ms"] - out["direct"]["p50_ms"]
    out["router_cpu_us_per_pick"] = cpu / picked * 1e6 if picked else None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--per-round", type=int, default=300, help="requests per target a round")
    parser.add_argument("--long-scale", type=float, default=0.25)
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS))
    parser.add_argument("--output", default="bench-results/extproc_envoy.json")
    args = parser.parse_args(argv)
    binary = find_envoy()
    if binary is None:
        print("bench extproc_envoy: no Envoy binary (make envoy): skipped", file=sys.stderr)
        return 0
    use_uvloop()
    engines = fast_engines("gw")
    addresses = [e.url.removeprefix("http://") for e in engines]
    router: ServerProcess | None = None
    gateways: list[Envoy] = []
    results: dict[str, Any] = {}
    try:
        serve = ["--port", "0", "--extproc-port", "0", "--log-level", "warning"]
        for engine in engines:
            serve += ["--engine", engine.url]
        router = ServerProcess("serve", serve)
        extproc_port = int(router.read_line(timeout=30).strip().rsplit(":", 1)[-1])
        picker = Envoy(binary, extproc_port)
        gateways.append(picker)
        plain = Envoy(binary, None, engines=addresses)
        gateways.append(plain)
        asyncio.run(_healthy(picker))
        targets = {
            "direct": [f"{e.url}/v1/completions" for e in engines],
            "envoy": [f"{plain.url}/v1/completions"],
            "envoy+extproc": [f"{picker.url}/v1/completions"],
            "kvroute HTTP": [f"{router.url}/v1/completions"],
        }
        for workload in args.workload or ["small", "long"]:
            scale = args.long_scale if workload == "long" else 1.0
            n = max(int(args.per_round * scale), 10)
            results[workload] = asyncio.run(
                measure(targets, router.proc.pid, workload, args.rounds, n)
            )
    finally:
        for gateway in gateways:
            gateway.stop()
        if router is not None:
            router.stop()
        for engine in engines:
            engine.stop()
    print(f"{'workload':<9}{'path':<15}{'p50 ms':>8}{'p99 ms':>8}{'n':>6}")
    for workload, res in results.items():
        for name in ("direct", "envoy", "envoy+extproc", "kvroute HTTP"):
            r = res[name]
            print(f"{workload:<9}{name:<15}{r['p50_ms']:>8.2f}{r['p99_ms']:>8.2f}{r['n']:>6}")
        print(
            f"{workload}: the ext_proc picker adds p50 {res['picker_added_p50_ms']:.2f} ms, "
            f"p99 {res['picker_added_p99_ms']:.2f} ms to plain Envoy (which adds "
            f"{res['envoy_added_p50_ms']:.2f} ms to direct; kvroute's HTTP API adds "
            f"{res['kvroute_http_added_p50_ms']:.2f} ms); "
            f"{res['router_cpu_us_per_pick']:.0f} us of kvroute CPU per request"
        )
    save_results(args.output, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
