"""How consistently two router replicas route one prefix, in both ways of sharing.

``python -m router.bench.replica_consistency [--redis-url URL] [--output FILE]`` starts
four emulated engines (real time, KV events with replay) and, for each sharing mode
(``index.backend: redis``, one index in Redis; ``replicated``, an index in each replica's
memory with decisions shared through a Redis stream), two routers in front of them, in
this process, on loopback. Then:

* **Same-prefix bursts.** Groups of ``--burst`` requests sharing a long prefix (the
  prompt differs only in its last words), sent alternately to replica A and replica B,
  one every ``gap`` milliseconds (each gap of ``--gaps-ms`` in turn; 0: all at once).
  A group is *split* when its members reach more than one engine; *cross-replica
  pairs apart* is the share of consecutive members, routed by different replicas, that
  went to different engines. Before a member's engine has even started its prefill,
  only the first member's decision record (in Redis, or on the stream) can keep the
  group together; the gap says how long the record had to reach the other replica.
* **Multi-turn conversations.** ``--conversations`` conversations of ``--turns`` turns,
  all at once, each turn sent to the other replica than the one before, ``--think-ms``
  after the answer to the turn before (a user reading it); *kept* is the share of turns
  after the first that reached the engine of the turn before. (Without a think time and
  with ``--no-load-push``, the next turn meets the previous one's request still counted
  in flight by the other replica, whose view of its peer's load is then up to
  ``index.redis.load_interval_s`` old, and is steered away from its engine by load in
  either mode; with ``index.redis.load_push`` the end reaches the peer on the decision
  stream first.)

Engine caches are reset between runs; Redis is a throw-away ``redis-server`` unless
``--redis-url`` names one (each run uses a namespace of its own).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import tempfile
import uuid
from collections.abc import Sequence
from typing import Any

import aiohttp

from router.app import RouterApp
from router.bench.report import save_results
from router.bench.throwaway_redis import run_on_redis
from router.config import load_config
from router.emulator import EmulatedEngine, EmulatorConfig
from router.emulator.server import start_engine

MODES = ("redis", "replicated")


def _words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


async def _engines(directory: str, count: int) -> list[EmulatedEngine]:
    return [
        await start_engine(
            EmulatorConfig(
                host="127.0.0.1",
                port=0,
                engine_id=f"consistency{i}",
                kv_events_endpoint=f"ipc://{directory}/events{i}",
                kv_events_replay_endpoint="tcp://127.0.0.1:*",
            )
        )
        for i in range(count)
    ]


async def _router(
    urls: list[str],
    mode: str,
    redis_url: str,
    namespace: str,
    budget_ms: float | None,
    load_push: bool = True,
) -> RouterApp:
    redis: dict[str, Any] = {"url": redis_url, "namespace": namespace, "load_push": load_push}
    if budget_ms is not None:
        redis["budget_ms"] = budget_ms
    config = load_config(
        overrides={
            "server": {"host": "127.0.0.1", "port": 0},
            "health": {"interval_s": 0.5},
            "index": {"backend": mode, "redis": redis},
            "engines": [{"url": u} for u in urls],
        },
        environ={},
    )
    app = RouterApp(config)
    await app.start()
    return app


async def _ask(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[str, str]:
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {data}")
        return resp.headers["x-kvroute-engine"], data["choices"][0]["text"]


async def _reset(http: aiohttp.ClientSession, engines: Sequence[EmulatedEngine]) -> None:
    for engine in engines:
        async with http.post(f"{engine.url}/reset_prefix_cache", json={}) as resp:
            resp.raise_for_status()
    await asyncio.sleep(0.2)  # the routers apply the engines' AllBlocksCleared events


async def _bursts(
    http: aiohttp.ClientSession,
    apps: Sequence[RouterApp],
    tag: str,
    groups: int,
    burst: int,
    gap_s: float,
    prefix_words: int,
) -> dict[str, Any]:
    async def member(g: int, i: int) -> str:
        await asyncio.sleep(i * gap_s)
        prompt = f"{_words(f'{tag}g{g}-', prefix_words)} member {i}"
        engine, _ = await _ask(http, apps[i % 2].url, {"prompt": prompt, "max_tokens": 1})
        return engine

    split = 0
    pairs = apart = 0
    for g in range(groups):
        engines = await asyncio.gather(*(member(g, i) for i in range(burst)))
        split += len(set(engines)) > 1
        for a, b in itertools.pairwise(engines):
            pairs += 1
            apart += a != b
    return {
        "groups": groups,
        "burst": burst,
        "gap_ms": gap_s * 1000,
        "split": split / groups,
        "pairs_apart": apart / max(pairs, 1),
    }


async def _conversations(
    http: aiohttp.ClientSession,
    apps: Sequence[RouterApp],
    tag: str,
    conversations: int,
    turns: int,
    system_words: int,
    think_s: float,
) -> dict[str, Any]:
    async def conversation(c: int) -> tuple[int, int]:
        history = f"{_words(f'{tag}sys-', system_words)} conversation {c}"
        last = None
        kept = 0
        for turn in range(turns):
            history += f" question {turn} " + _words(f"{tag}c{c}t{turn}-", 60)
            engine, text = await _ask(
                http, apps[(c + turn) % 2].url, {"prompt": history, "max_tokens": 16}
            )
            history += " " + text
            await asyncio.sleep(think_s)
            kept += engine == last
            last = engine
        return kept, turns - 1

    results = await asyncio.gather(*(conversation(c) for c in range(conversations)))
    kept = sum(k for k, _ in results)
    follow_ups = sum(n for _, n in results)
    return {
        "conversations": conversations,
        "turns": turns,
        "think_ms": think_s * 1000,
        "kept": kept / max(follow_ups, 1),
    }


async def run(
    redis_url: str,
    groups: int,
    burst: int,
    gaps_ms: Sequence[float],
    conversations: int,
    turns: int,
    think_s: float,
    budget_ms: float | None = None,
    load_push: bool = True,
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvroute-consistency-") as directory:
        engines = await _engines(directory, 4)
        try:
            urls = [e.url for e in engines]
            async with aiohttp.ClientSession() as http:
                for mode in MODES:
                    namespace = f"bench-{uuid.uuid4().hex[:8]}"
                    apps = [
                        await _router(urls, mode, redis_url, namespace, budget_ms, load_push)
                        for _ in range(2)
                    ]
                    try:
                        for app in apps:
                            assert app.subscriber is not None
                            await app.subscriber.wait_synced(5)
                        for n, gap in enumerate(gaps_ms):
                            await _reset(http, engines)
                            row = await _bursts(
                                http, apps, f"{mode}{n}", groups, burst, gap / 1000, 512
                            )
                            rows.append({"mode": mode, "kind": "burst", **row})
                        await _reset(http, engines)
                        before = _fallbacks(apps)
                        row = await _conversations(
                            http, apps, mode, conversations, turns, 512, think_s
                        )
                        row["index_fallbacks"] = _fallbacks(apps) - before
                        rows.append({"mode": mode, "kind": "conversation", **row})
                    finally:
                        for app in apps:
                            await app.stop()
        finally:
            for engine in engines:
                await engine.stop()
    return {"rows": rows}


def _fallbacks(apps: Sequence[RouterApp]) -> int:
    """Lookups the shared index did not answer in its budget (answered from the replica's
    own recent decisions instead); 0 in the replicated mode, whose lookups are local."""
    return sum(app.shadowed.counters.fallbacks for app in apps if app.shadowed is not None)


def report(results: dict[str, Any]) -> None:
    print("same-prefix bursts alternating between two replicas (lower is better):")
    print(f"{'mode':>12}  {'gap ms':>7}  {'groups split':>12}  {'cross-replica pairs apart':>25}")
    for r in results["rows"]:
        if r["kind"] == "burst":
            print(
                f"{r['mode']:>12}  {r['gap_ms']:>7.0f}  {r['split']:>12.0%}  "
                f"{r['pairs_apart']:>25.0%}"
            )
    print("multi-turn conversations, each turn through the other replica (higher is better):")
    for r in results["rows"]:
        if r["kind"] == "conversation":
            print(
                f"{r['mode']:>12}  {r['conversations']} conversations x {r['turns']} turns, "
                f"{r['think_ms']:.0f} ms think time: "
                f"{r['kept']:.0%} of follow-up turns on the engine of the turn before "
                f"({r['index_fallbacks']} lookups over the Redis budget)"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", help="use this Redis instead of a throw-away one")
    parser.add_argument("--output", default="bench-results/replica_consistency.json")
    parser.add_argument("--groups", type=int, default=30, help="bursts per gap")
    parser.add_argument("--burst", type=int, default=4, help="requests per burst")
    parser.add_argument(
        "--gaps-ms", default="0,1,2,5,20", help="comma-separated gaps between members"
    )
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--think-ms", type=float, default=300, help="pause between turns")
    parser.add_argument(
        "--budget-ms",
        type=float,
        help="index.redis.budget_ms of the routers (default: the configuration's default)",
    )
    parser.add_argument(
        "--load-push",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="index.redis.load_push of the routers (--no-load-push: peers' load only "
        "through the exchange every load_interval_s)",
    )
    args = parser.parse_args(argv)
    gaps = [float(g) for g in args.gaps_ms.split(",") if g.strip()]
    logging.basicConfig(level=logging.ERROR)
    results = run_on_redis(
        args.redis_url,
        lambda url: run(
            url,
            args.groups,
            args.burst,
            gaps,
            args.conversations,
            args.turns,
            args.think_ms / 1000,
            args.budget_ms,
            args.load_push,
        ),
    )
    report(results)
    save_results(args.output, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
