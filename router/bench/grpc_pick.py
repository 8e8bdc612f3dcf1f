"""What a gateway waits for a decision: gRPC Pick latency, beside the HTTP path's.

``python -m router.bench.grpc_pick`` (``make bench-grpc``, part of ``make bench``)
starts four emulated engines in this process and ``kvroute serve --grpc-port 0`` in
its own process, warms the engines with eight groups of requests sharing a
1,024-token prefix (so decisions find cached prefixes in the index), then measures in
interleaved rounds, one call at a time:

* ``Pick`` over gRPC with a text prompt (tokenize, hash, look up, decide, hold load),
  and with precomputed block keys, as the client sees it (each followed by an untimed
  ``Release``);
* a ``grpc.health.v1`` Check on the same channel: the floor any unary call costs here;
* the same decision in process (``Decider.prepare`` + ``plan`` + hold and release, the
  code Pick and the HTTP API share), on a second router in this process with the same
  engines and state: what gRPC itself adds is the difference;
* the HTTP API's routing time for the same prompts, from the router's own
  ``kvroute_routing_seconds`` (receive to forward: parse, tokenize, hash, decide), whose
  mean is exact and whose percentiles are read from histogram buckets.

Prints a table and writes ``bench-results/grpc_pick.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from router.app import RouterApp
from router.config import load_config
from router.emulator import EmulatedEngine, EmulatorConfig, start_engine
from router.engine_model import EngineParams
from router.grpc.gen.kvroute.v1 import router_pb2 as pb
from router.grpc.gen.kvroute.v1 import router_pb2_grpc as pb_grpc
from router.process import ServerProcess
from router.serving.parsing import parse_completion
from router.workloads.stats import percentile

GROUPS = 8
PREFIX_WORDS = 1024
SUFFIX_WORDS = 64


def prompt(group: int, i: int) -> str:
    prefix = " ".join(f"g{group}w{j}" for j in range(PREFIX_WORDS))
    return prefix + " " + " ".join(f"q{i}x{j}" for j in range(SUFFIX_WORDS))


async def _engines(n: int) -> list[EmulatedEngine]:
    params = EngineParams(num_gpu_blocks=16_384, max_model_len=16_384)
    return [
        await start_engine(
            EmulatorConfig(
                host="127.0.0.1",
                port=0,
                params=params,
                time_scale=0.0001,
                engine_id=f"bench{i}",
                kv_events_endpoint="tcp://127.0.0.1:*",
                kv_events_replay_endpoint="tcp://127.0.0.1:*",
            )
        )
        for i in range(n)
    ]


def _histogram(text: str, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """Cumulative buckets (upper bound, count), sum and count of a histogram."""
    buckets: list[tuple[float, float]] = []
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for s in family.samples:
            if s.name.endswith("_bucket"):
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_sum"):
                total = s.value
            elif s.name.endswith("_count"):
                count = s.value
    return sorted(buckets), total, count


def _bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """A quantile from cumulative buckets, interpolated linearly inside its bucket."""
    count = buckets[-1][1]
    rank = q * count
    lower_bound, lower_count = 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if bound == float("inf"):
                return lower_bound
            span = cumulative - lower_count
            share = (rank - lower_count) / span if span else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, cumulative
    return lower_bound


def _stats(samples: list[float]) -> dict[str, float]:
    return {
        "p50_us": percentile(samples, 50) * 1e6,
        "p99_us": percentile(samples, 99) * 1e6,
        "n": len(samples),
    }


async def measure(rounds: int, per_round: int) -> dict[str, Any]:
    engines = await _engines(4)
    urls = [e.url for e in engines]
    args = ["--port", "0", "--grpc-port", "0", "--log-level", "warning"]
    for url in urls:
        args += ["--engine", url]
    server = await asyncio.to_thread(ServerProcess, "serve", args)
    local: RouterApp | None = None
    try:
        line = await asyncio.to_thread(server.read_line, 30)
        grpc_address = line.strip().rsplit(" ", 1)[-1]
        async with aiohttp.ClientSession() as http:
            for group in range(GROUPS):  # each engine learns some groups' prefixes
                body = {"prompt": prompt(group, -1), "max_tokens": 1}
                async with http.post(f"{server.url}/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
            await asyncio.sleep(1.0)  # KV events reach both routers
            config = load_config(
                overrides={
                    "server": {"host": "127.0.0.1", "port": 0},
                    "engines": [{"url": u} for u in urls],
                },
                environ={},
            )
            local = RouterApp(config)
            await local.start()
            await asyncio.sleep(1.0)
            text_ms: list[float] = []
            keys_ms: list[float] = []
            inproc: list[float] = []
            floor: list[float] = []
            async with aio.insecure_channel(grpc_address) as channel:
                stub = pb_grpc.RouterStub(channel)
                health = health_pb2_grpc.HealthStub(channel)
                check = health_pb2.HealthCheckRequest(service="kvroute.v1.Router")
                for r in range(rounds):
                    for i in range(per_round):
                        n = r * per_round + i
                        text = prompt(n % GROUPS, n)
                        # in process: the decision code every API shares
                        parsed = parse_completion({"prompt": text, "max_tokens": 16})
                        t0 = time.perf_counter()
                        model = local.registry.models()[0]
                        parsed.model = model
                        route = await local.decider.prepare(f"in-{n}", model, parsed, None)
                        plan = await local.decider.plan(model, route, route.prompt_tokens, None)
                        lease = local.picks.hold(plan)
                        local.picks.end(lease, "released")
                        inproc.append(time.perf_counter() - t0)
                        # the floor: an RPC that does nothing
                        t0 = time.perf_counter()
                        await health.Check(check)
                        floor.append(time.perf_counter() - t0)
                        # over gRPC, text prompt
                        request = pb.PickRequest(request_id=f"t-{n}", text=text, max_tokens=16)
                        t0 = time.perf_counter()
                        await stub.Pick(request)
                        text_ms.append(time.perf_counter() - t0)
                        await stub.Release(pb.ReleaseRequest(request_id=f"t-{n}"))
                        # over gRPC, precomputed block keys
                        keyed = pb.PickRequest(
                            request_id=f"k-{n}",
                            block_keys=pb.BlockKeys(
                                keys=list(route.keys), prompt_tokens=route.prompt_tokens
                            ),
                            max_tokens=16,
                        )
                        t0 = time.perf_counter()
                        await stub.Pick(keyed)
                        keys_ms.append(time.perf_counter() - t0)
                        await stub.Release(pb.ReleaseRequest(request_id=f"k-{n}"))
            # the HTTP API's routing time for the same prompts
            async with http.get(f"{server.url}/metrics") as resp:
                before = _histogram(await resp.text(), "kvroute_routing_seconds")
            n_http = min(per_round * rounds, 400)
            for n in range(n_http):
                body = {"prompt": prompt(n % GROUPS, 10_000 + n), "max_tokens": 1}
                async with http.post(f"{server.url}/v1/completions", json=body) as resp:
                    await resp.read()
            async with http.get(f"{server.url}/metrics") as resp:
                after = _histogram(await resp.text(), "kvroute_routing_seconds")
        diff = [(bound, count - dict(before[0]).get(bound, 0.0)) for bound, count in after[0]]
        http_count = after[2] - before[2]
        http_mean = (after[1] - before[1]) / http_count if http_count else float("nan")
        return {
            "grpc_pick_text": _stats(text_ms),
            "grpc_pick_block_keys": _stats(keys_ms),
            "in_process_decision": _stats(inproc),
            "grpc_health_check": _stats(floor),
            "http_routing": {
                "p50_us": _bucket_quantile(diff, 0.5) * 1e6,
                "p99_us": _bucket_quantile(diff, 0.99) * 1e6,
                "mean_us": http_mean * 1e6,
                "n": int(http_count),
            },
            "prompt_tokens": PREFIX_WORDS + SUFFIX_WORDS,
            "engines": len(engines),
        }
    finally:
        if local is not None:
            await local.stop()
        await asyncio.to_thread(server.stop)
        for engine in engines:
            await engine.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--per-round", type=int, default=500, help="calls of each kind per round")
    parser.add_argument("--output", default="bench-results/grpc_pick.json")
    args = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    results = asyncio.run(measure(args.rounds, args.per_round))
    rows = [
        ("gRPC Pick, text prompt (client round trip)", results["grpc_pick_text"]),
        ("gRPC Pick, block keys (client round trip)", results["grpc_pick_block_keys"]),
        ("gRPC health Check (any unary call's floor)", results["grpc_health_check"]),
        ("decision in process (shared by every API)", results["in_process_decision"]),
        ("HTTP API routing, kvroute_routing_seconds", results["http_routing"]),
    ]
    print(f"{'':<46}{'p50 µs':>9}{'p99 µs':>9}{'n':>7}")
    for name, r in rows:
        print(f"{name:<46}{r['p50_us']:>9.0f}{r['p99_us']:>9.0f}{r['n']:>7}")
    print(
        f"HTTP routing mean {results['http_routing']['mean_us']:.0f} µs (its percentiles are "
        f"interpolated inside histogram buckets); prompts of {results['prompt_tokens']} tokens, "
        f"{results['engines']} engines"
    )
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
