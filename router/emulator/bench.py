"""Emulator benchmarks: engine-model speed on a virtual clock, HTTP throughput in real time.

``python -m router.emulator.bench [model|http|all] [TRACE]`` prints a table per part and writes
the numbers to ``bench-results/emulator.json``; docs/engine-emulator.md quotes them.

* ``model``: the Mooncake conversation trace (12,031 requests, ../shared/workloads)
  replayed on 8 ``h100-8b`` engines, round robin, on a virtual clock: how fast the pure
  engine model runs, the load the cluster simulator will put on it.
* ``http``: one ``kvroute engine`` process answering tiny non-streaming completions
  from concurrent clients in this process (loopback only, bounded in time).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import sys
import time
from pathlib import Path
from typing import Any

from router.engine_model import EngineModel, RequestSpec, preset
from router.process import EngineProcess

# The project's shared/ folder sits beside the repository.
TRACE = (
    Path(__file__).resolve().parents[2].parent
    / "shared/workloads/mooncake/conversation_trace.jsonl"
)
RESULTS = Path("bench-results/emulator.json")
_TRACE_BLOCK = 512


def _trace_tokens(hash_ids: list[int], length: int) -> list[int]:
    """Expand Mooncake block ids into deterministic token ids (equal ids, equal tokens)."""
    tokens: list[int] = []
    for h in hash_ids:
        base = 1_024 + (h * 7_919) % 100_000
        tokens.extend(range(base, base + _TRACE_BLOCK))
    return tokens[:length]


def bench_model(trace: Path = TRACE, engines: int = 8) -> dict[str, Any]:
    """Replay the trace round robin on ``engines`` models; report wall time and counters."""
    if not trace.exists():
        return {"skipped": f"{trace} not found"}
    rows = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    params = preset("h100-8b")
    models = [EngineModel(params, hash_seed=i, emit_events=False) for i in range(engines)]
    # Events: (time, kind, engine or request index); kind 0 = step end, 1 = arrival.
    queue: list[tuple[float, int, int]] = [(r["timestamp"] / 1e3, 1, i) for i, r in enumerate(rows)]
    heapq.heapify(queue)
    busy = [False] * engines
    steps = 0
    ttfts: list[float] = []
    started = time.perf_counter()
    while queue:
        now, kind, index = heapq.heappop(queue)
        if kind == 1:
            row = rows[index]
            target = index % engines
            spec = RequestSpec(
                str(index),
                _trace_tokens(row["hash_ids"], row["input_length"]),
                max(1, row["output_length"]),
            )
            models[target].submit(spec, now)
        else:
            target = index
            busy[target] = False
            for out in models[target].finish_step(now).outputs:
                if out.ttft is not None:
                    ttfts.append(out.ttft)
        if not busy[target]:
            duration = models[target].start_step(now)
            if duration is not None:
                busy[target] = True
                steps += 1
                heapq.heappush(queue, (now + duration, 0, target))
    elapsed = time.perf_counter() - started
    stats = [m.stats() for m in models]
    hits = sum(s.prefix_cache_hits for s in stats)
    queries = sum(s.prefix_cache_queries for s in stats)
    ttfts.sort()
    return {
        "requests": len(rows),
        "engines": engines,
        "steps": steps,
        "wall_s": round(elapsed, 2),
        "us_per_step": round(elapsed / steps * 1e6, 1),
        "generated_tokens": sum(s.generation_tokens for s in stats),
        "hit_rate": round(hits / queries, 4),
        "ttft_p50_s": round(ttfts[len(ttfts) // 2], 3),
        "ttft_p99_s": round(ttfts[int(len(ttfts) * 0.99)], 3),
        "preemptions": sum(s.num_preemptions for s in stats),
    }


async def _hammer(url: str, clients: int, seconds: float) -> tuple[int, float]:
    import aiohttp

    body = json.dumps({"prompt": "hello world", "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json"}
    done = 0
    async with aiohttp.ClientSession() as http:
        deadline = time.perf_counter() + seconds

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                async with http.post(f"{url}/v1/completions", data=body, headers=headers) as r:
                    await r.read()
                    assert r.status == 200
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return done, time.perf_counter() - start


def bench_http(clients: int = 32, seconds: float = 5.0) -> dict[str, Any]:
    """Requests per second one engine process serves (tiny prompts, 1 output token)."""
    results: dict[str, Any] = {"clients": clients, "seconds": seconds}
    for scale in (0.001, 1.0):
        engine = EngineProcess(["--port", "0", "--time-scale", str(scale)])
        try:
            asyncio.run(_hammer(engine.url, clients, 0.5))  # warm up
            done, elapsed = asyncio.run(_hammer(engine.url, clients, seconds))
        finally:
            engine.stop()
        results[f"req_per_s_time_scale_{scale}"] = round(done / elapsed)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m router.emulator.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("part", nargs="?", default="all", choices=["model", "http", "all"])
    parser.add_argument(
        "trace", nargs="?", type=Path, default=TRACE, help="the trace `model` replays"
    )
    args = parser.parse_args(argv)
    part, trace = args.part, args.trace
    results: dict[str, Any] = {}
    if part in ("model", "all"):
        results["model"] = bench_model(trace)
    if part in ("http", "all"):
        results["http"] = bench_http()
    for name, numbers in results.items():
        print(f"{name}:")
        for key, value in numbers.items():
            print(f"  {key:<32} {value}")
    RESULTS.parent.mkdir(exist_ok=True)
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    RESULTS.write_text(json.dumps({**previous, **results}, indent=2) + "\n")
    print(f"written to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
