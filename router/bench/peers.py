"""kvroute's request path beside the Rust routers': added latency, throughput, CPU.

``python -m router.bench.peers`` (``make bench-peers``) starts two emulated engines with
no artificial delay (``--time-scale 0.0001``) and, in front of the same two, each router
as a child process on loopback: ``kvroute serve`` at its defaults, sglang-router
(``cache_aware``) and vllm-router (``cache_aware``), installed from PyPI into
``build/compat`` as ``make bench-compare`` installs them (a router that cannot be
installed is reported and left out). Then, in interleaved rounds so that drift on a
shared machine hits every target alike, for each workload:

* latency: non-streamed completions one at a time, through each router and straight to
  the engines (alternating, as a client-side round robin): p50/p99 and the added p50/p99
  over direct;
* throughput: the same requests with ``--concurrency`` in flight;
* CPU per request: user + system seconds of the router's whole process group (from
  ``/proc``) over the requests of both phases, divided by their number.

Workloads: ``small`` (a 40-token prompt, 2 output tokens) and ``long`` (8,192-token
prompts in eight groups sharing an 8,000-token prefix, so cache-aware routers find
prefixes). Every process shares both cores, as they must on a small machine: read the
ratios. Prints a table and writes ``bench-results/peers.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from router.bench.report import save_results
from router.emulator.compat import RouterProcess, _common_args, _ready, install
from router.process import EngineProcess, ServerProcess
from router.workloads.stats import percentile

BUILD = Path("build/compat")
HEADERS = {"Content-Type": "application/json"}
MODEL = "kvroute-emulated"
LONG_GROUPS = 8
LONG_PREFIX = 8_000
LONG_TOKENS = 8_192


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds so far of every live process in process group ``pgid``."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 of stat: the process group
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def use_uvloop() -> None:
    """Run this process's event loops on uvloop when it is installed."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass


def fast_engines(prefix: str, n: int = 2) -> list[EngineProcess]:
    """``n`` emulated engines with no artificial delay, room for 8,192-token prompts."""
    args = ["--port", "0", "--time-scale", "0.0001", "--max-model-len", "16384"]
    args += ["--cache-blocks", "16384"]
    return [EngineProcess([*args, "--engine-id", f"{prefix}{i}"]) for i in range(n)]


def small_bodies() -> Iterator[bytes]:
    body = json.dumps(
        {"model": MODEL, "prompt": "how fast is the router " * 8, "max_tokens": 2}
    ).encode()
    return itertools.repeat(body)


def long_bodies() -> Iterator[bytes]:
    prefixes = [" ".join(f"g{g}w{j}" for j in range(LONG_PREFIX)) for g in range(LONG_GROUPS)]
    for n in itertools.count():
        suffix = " ".join(f"q{n}x{j}" for j in range(LONG_TOKENS - LONG_PREFIX))
        prompt = prefixes[n % LONG_GROUPS] + " " + suffix
        yield json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2}).encode()


WORKLOADS = {"small": small_bodies, "long": long_bodies}


@dataclass
class Target:
    """Where requests go: straight to the engines, or through one router."""

    name: str
    urls: list[str]
    pgid: int | None = None  # the router's process group, for its CPU
    latency: list[float] = field(default_factory=list)
    rps: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    relayed: int = 0

    def summary(self) -> dict[str, Any]:
        return {
            "p50_ms": percentile(self.latency, 50) * 1e3,
            "p99_ms": percentile(self.latency, 99) * 1e3,
            "rps": sorted(self.rps)[len(self.rps) // 2],
            "cpu_us_per_request": self.cpu_s / self.relayed * 1e6 if self.relayed else None,
        }


async def _burst(
    session: aiohttp.ClientSession,
    urls: list[str],
    bodies: Iterator[bytes],
    n: int,
    concurrency: int,
) -> tuple[list[float], float]:
    latencies: list[float] = []
    remaining = iter(range(n))
    turn = itertools.cycle(urls)

    async def worker() -> None:
        for _ in remaining:
            url = next(turn)
            body = next(bodies)
            t0 = time.perf_counter()
            async with session.post(url, data=body, headers=HEADERS) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{url} answered {resp.status}: {await resp.text()}")
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - t0


async def measure(
    targets: list[Target],
    workload: str,
    rounds: int,
    serial: int,
    parallel: int,
    concurrency: int,
) -> dict[str, Any]:
    bodies = WORKLOADS[workload]()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for target in targets:  # warm connections, caches and the routers' trees
            await _burst(session, target.urls, bodies, max(serial // 4, 16), concurrency)
        for r in range(rounds):
            order = targets[r % len(targets) :] + targets[: r % len(targets)]
            for target in order:
                before = group_cpu_seconds(target.pgid) if target.pgid else 0.0
                samples, _ = await _burst(session, target.urls, bodies, serial, 1)
                target.latency += samples
                _, elapsed = await _burst(session, target.urls, bodies, parallel, concurrency)
                target.rps.append(parallel / elapsed)
                if target.pgid:
                    target.cpu_s += group_cpu_seconds(target.pgid) - before
                    target.relayed += serial + parallel
    out = {t.name: t.summary() for t in targets}
    direct = out["direct"]
    for res in out.values():
        res["added_p50_ms"] = res["p50_ms"] - direct["p50_ms"]
        res["added_p99_ms"] = res["p99_ms"] - direct["p99_ms"]
        res["throughput_ratio"] = res["rps"] / direct["rps"]
    return out


def _peer_args(name: str, executable: Path, engines: list[str]) -> list[str]:
    policy = ["--policy", "cache_aware", "--worker-urls", *engines]
    return [str(executable), *_common_args(name), *policy]


async def _start_peers(
    names: list[str], engines: list[str]
) -> tuple[list[tuple[str, RouterProcess]], list[str]]:
    """Each peer installed, started and routing; (started, why the others are not)."""
    started: list[tuple[str, RouterProcess]] = []
    problems: list[str] = []
    async with aiohttp.ClientSession() as http:
        for name in names:
            executable, why = await asyncio.to_thread(install, BUILD, name)
            if executable is None:
                problems.append(f"{name}: {why}")
                continue
            router = RouterProcess(_peer_args(name, executable, engines))
            not_ready = await _ready(http, router)
            if not_ready:
                problems.append(f"{name}: {not_ready}")
                router.stop()
                continue
            started.append((name, router))
    return started, problems


def _print(results: dict[str, dict[str, Any]]) -> None:
    head = (
        f"{'workload':<9}{'target':<15}{'p50 ms':>8}{'p99 ms':>8}{'+p50 ms':>9}{'+p99 ms':>9}"
        f"{'req/s':>8}{'vs direct':>10}{'CPU µs/req':>11}"
    )
    print(head)
    for workload, res in results.items():
        for name, r in res.items():
            cpu = r["cpu_us_per_request"]
            print(
                f"{workload:<9}{name:<15}{r['p50_ms']:>8.2f}{r['p99_ms']:>8.2f}"
                f"{r['added_p50_ms']:>9.2f}{r['added_p99_ms']:>9.2f}{r['rps']:>8.0f}"
                f"{r['throughput_ratio']:>10.0%}{'' if cpu is None else f'{cpu:.0f}':>11}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS))
    parser.add_argument("--serial", type=int, default=400, help="latency requests per round")
    parser.add_argument("--parallel", type=int, default=1500, help="throughput requests per round")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--long-scale",
        type=float,
        default=0.25,
        help="the long workload sends this share of --serial and --parallel",
    )
    parser.add_argument(
        "--peer",
        action="append",
        choices=["sglang-router", "vllm-router", "none"],
        help="the peers to run (repeatable; default both; 'none': kvroute alone)",
    )
    parser.add_argument("--router-args", default="", help="extra `kvroute serve` arguments")
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        help="also run the kvroute of another checkout (e.g. `git worktree add DIR COMMIT`, "
        "its compiled helper built), as the target 'kvroute@base', to compare commits",
    )
    parser.add_argument("--output", default="bench-results/peers.json")
    args = parser.parse_args(argv)
    workloads = args.workload or ["small", "long"]
    peers = [p for p in args.peer or ["sglang-router", "vllm-router"] if p != "none"]
    use_uvloop()
    engines = fast_engines("peers")
    urls = [e.url for e in engines]
    kvroute: ServerProcess | None = None
    baseline: ServerProcess | None = None
    peer_procs: list[tuple[str, RouterProcess]] = []
    results: dict[str, Any] = {}
    try:
        serve = ["--port", "0", "--log-level", "warning", *args.router_args.split()]
        for url in urls:
            serve += ["--engine", url]
        kvroute = ServerProcess("serve", serve)
        if args.baseline:
            baseline = ServerProcess("serve", serve, checkout=args.baseline)
        peer_procs, problems = asyncio.run(_start_peers(peers, urls))
        for problem in problems:
            print(f"bench-peers: left out {problem}", file=sys.stderr)
        targets_of = {
            "direct": ("direct", [f"{u}/v1/completions" for u in urls], None),
            "kvroute": ("kvroute", [f"{kvroute.url}/v1/completions"], kvroute.proc.pid),
        }
        if baseline is not None:
            base = ("kvroute@base", [f"{baseline.url}/v1/completions"], baseline.proc.pid)
            targets_of["kvroute@base"] = base
        for name, p in peer_procs:
            targets_of[name] = (name, [f"{p.url}/v1/completions"], p.proc.pid)
        for workload in workloads:
            scale = args.long_scale if workload == "long" else 1.0
            targets = [Target(name, t_urls, pgid) for name, t_urls, pgid in targets_of.values()]
            results[workload] = asyncio.run(
                measure(
                    targets,
                    workload,
                    args.rounds,
                    max(int(args.serial * scale), 10),
                    max(int(args.parallel * scale), 10),
                    args.concurrency,
                )
            )
    finally:
        for _, p in peer_procs:
            p.stop()
        for server in (kvroute, baseline):
            if server is not None:
                server.stop()
        for e in engines:
            e.stop()
    _print(results)
    settings = {k: v for k, v in vars(args).items() if k != "output"}
    save_results(args.output, {"settings": settings, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
