"""Disaggregated vs aggregated serving on the same engines, side by side.

``python -m router.bench.disagg`` (``make bench-disagg``) starts four emulated engines
per target, in real time (``--time-scale 1``: an 8B-on-H100 timing model), and a
``kvroute serve`` in front of them, and replays one long-prompt workload against:

* ``disagg``: 2 prefill + 2 decode engines, kvroute's default policy (NIXL handoff);
* ``aggregated``: the same 4 engines serving prefill and decode, kvroute's policy;
* ``rr-pairs``: 2 prefill + 2 decode engines, pairs chosen round robin.

The workload: long prompts arriving as a Poisson process, half of them unique, half a
shared document plus a unique part. Prefill competes with decode on an aggregated
engine: every prefill step stalls the sequences decoding there, which shows in
inter-token latency; a cache-aware choice of the prefill engine turns the shared
documents into prefix hits, which shows in TTFT. It prints TTFT and ITL
p50/p99 and throughput per target and writes ``bench-results/disagg.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
from pathlib import Path
from typing import Any

from router.bench.loadgen import run_load
from router.process import EngineProcess, ServerProcess
from router.workloads.generated import words
from router.workloads.spec import RequestSpec
from router.workloads.stats import percentile

TARGETS = {
    "disagg": (["prefill", "prefill", "decode", "decode"], "kv_cost"),
    "aggregated": (["both", "both", "both", "both"], "kv_cost"),
    "rr-pairs": (["prefill", "prefill", "decode", "decode"], "round_robin"),
}


def workload(
    n: int,
    seed: int,
    min_tokens: int,
    max_tokens: int,
    output: int,
    rate: float,
    docs: int,
    doc_tokens: int,
) -> list[RequestSpec]:
    """Long prompts arriving as a Poisson process: half are unique, half ask about one of
    ``docs`` shared documents (a document and a unique part long enough to be split)."""
    rng = random.Random(seed)
    documents = [words(rng, doc_tokens, f"doc{d}x") for d in range(docs)]
    specs, at = [], 0.0
    for i in range(n):
        at += rng.expovariate(rate)
        body = words(rng, rng.randrange(min_tokens, max_tokens), f"r{i}x")
        text = f"{rng.choice(documents)} {body}" if i % 2 == 0 else body
        specs.append(RequestSpec(prompt=text, max_tokens=output, group=f"r{i}", at=at))
    return specs


def run_target(roles: list[str], policy: str, specs: list[RequestSpec], timeout: float) -> Any:
    engines: list[EngineProcess] = []
    router = None
    try:
        with tempfile.TemporaryDirectory(prefix="kvroute-disagg-") as tmp:
            args = []
            for i, role in enumerate(roles):
                engine = EngineProcess(
                    [
                        "--port",
                        "0",
                        "--role",
                        role,
                        "--engine-id",
                        f"{role}{i}",
                        "--kv-events-endpoint",
                        f"ipc://{tmp}/e{i}",
                        "--kv-events-replay-endpoint",
                        "tcp://127.0.0.1:*",
                    ]
                )
                engines.append(engine)
                flag = "--engine" if role == "both" else f"--{role}"
                args += [flag, engine.url]
            router = ServerProcess(
                "serve", ["--port", "0", "--policy", policy, "--log-level", "warning", *args]
            )
            return asyncio.run(run_load(router.url, specs, concurrency=len(specs), timeout=timeout))
    finally:
        if router is not None:
            router.stop()
        for engine in engines:
            engine.stop()


def summarize(results: list[Any], wall: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [gap for r in ok for gap in r.itl]
    output = sum(r.completion_tokens for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "itl_p50_ms": percentile(itl, 50) * 1e3,
        "itl_p99_ms": percentile(itl, 99) * 1e3,
        "output_tokens_per_s": output / wall if wall else 0.0,
        "requests_per_s": len(ok) / wall if wall else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--rate", type=float, default=6.0, help="arrivals per second")
    parser.add_argument("--min-prompt", type=int, default=2000)
    parser.add_argument("--max-prompt", type=int, default=6000)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--docs", type=int, default=8, help="shared documents")
    parser.add_argument("--doc-tokens", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output", default="bench-results/disagg.json")
    args = parser.parse_args(argv)
    specs = workload(
        args.requests,
        args.seed,
        args.min_prompt,
        args.max_prompt,
        args.output_tokens,
        args.rate,
        args.docs,
        args.doc_tokens,
    )
    duration = specs[-1].at or 0.0
    report: dict[str, Any] = {
        "workload": {
            "requests": args.requests,
            "rate_per_s": args.rate,
            "prompt_tokens": [args.min_prompt, args.max_prompt],
            "docs": args.docs,
            "doc_tokens": args.doc_tokens,
            "output_tokens": args.output_tokens,
        },
    }
    for name, (roles, policy) in TARGETS.items():
        results = run_target(roles, policy, specs, timeout=120)
        wall = max((r.sent_at + r.e2e for r in results), default=0.0)
        report[name] = summarize(results, wall or duration)
    cols = (
        "ttft_p50_ms",
        "ttft_p99_ms",
        "itl_p50_ms",
        "itl_p99_ms",
        "output_tokens_per_s",
        "errors",
    )
    print(f"{'target':<12}" + "".join(f"{c:>21}" for c in cols))
    for name in TARGETS:
        row = report[name]
        print(f"{name:<12}" + "".join(f"{row[c]:>21.1f}" for c in cols))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
