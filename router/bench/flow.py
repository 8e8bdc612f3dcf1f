"""Flow control past capacity (docs/benchmarks.md "Flow control"; ``make bench-flow``).

``python -m router.bench.flow`` starts emulated engines and ``kvroute serve`` in processes
of their own, with ``limits.max_inflight`` as the pool's capacity, and drives them with
``kvroute bench --tenants`` workloads (:mod:`router.bench.tenants`):

* **fairness**: a quiet tenant alone, then beside a noisy tenant sending 10x its rate
  (past capacity), with flow control's ``vtc`` fairness and with the plain FIFO queue
  (``flow.enabled: false``), and with ``flow.tenant_share`` capping the slots one
  tenant holds (with prefill isolation, the default, and without): the quiet tenant's
  TTFT p99 against its value alone;
* **priority**: a high-priority tenant alone (unloaded), then beside low-priority
  traffic at 5x its rate that saturates the pool and sheddable traffic at 2x (with
  prefill isolation and without): the high band's TTFT p99 against its unloaded value,
  and refusals per band (only the sheddable band may be refused);
* **shared rate limit**: two router replicas sharing one Redis enforce one key's
  requests-per-minute limit, offered twice the limit through both for one window;
  passed requests against the limit (the bucket's burst included), then with Redis
  stopped: each replica limits alone and counts the fallbacks.

Prints a table and writes ``bench-results/flow.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from router.bench.tenants import TenantSpec, render_rows, run_tenants, summarize_tenant
from router.bench.throwaway_redis import RedisServer
from router.process import EngineProcess, ServerProcess


class Fleet:
    """Emulated engines and one or more routers with one configuration."""

    def __init__(self, engines: int, config: dict[str, Any], replicas: int = 1) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvroute-flow-"))
        path = self.dir / "router.yaml"
        path.write_text(yaml.safe_dump(config))
        self.engines = [EngineProcess(["--port", "0"]) for _ in range(engines)]
        self.routers: list[ServerProcess] = []
        try:
            for _ in range(replicas):
                args = ["--port", "0", "--config", str(path)]
                for engine in self.engines:
                    args += ["--engine", engine.url]
                self.routers.append(ServerProcess("serve", args))
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return self.routers[0].url

    def stop(self) -> None:
        for proc in [*self.routers, *self.engines]:
            proc.stop()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _config(capacity: int, flow: bool, **extra: Any) -> dict[str, Any]:
    return {
        "limits": {"max_inflight": capacity, "admission_timeout_s": 60},
        "flow": {"enabled": flow, **extra},
        "server": {"log_level": "warning"},
    }


async def _rows(url: str, tenants: list[TenantSpec], duration: float) -> list[dict[str, Any]]:
    results = await run_tenants(url, tenants, duration)
    return [summarize_tenant(t, results[t.name], duration) for t in tenants]


async def _warm(url: str, tenant: TenantSpec) -> None:
    """A few requests as ``tenant``: another tenant or band would count as one that
    outranks it for ``flow.prefill_reserve_window_s`` (the prefill reserve)."""
    async with aiohttp.ClientSession() as session:
        for _ in range(5):
            body = {"prompt": "warm up " * 20, "max_tokens": 4}
            headers = tenant.headers()
            async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
                await resp.read()


def _scenario(
    name: str, config: dict[str, Any], engines: int, tenants: list[TenantSpec], duration: float
) -> list[dict[str, Any]]:
    with Fleet(engines, config) as fleet:
        asyncio.run(_warm(fleet.url, tenants[0]))
        rows = asyncio.run(_rows(fleet.url, tenants, duration))
    print(f"\n{name}\n{render_rows(rows)}")
    return rows


def fairness(args: argparse.Namespace) -> dict[str, Any]:
    shape = {"prompt_tokens": args.prompt, "output_tokens": args.output}
    quiet = TenantSpec("quiet", args.quiet_rate, **shape)
    noisy = TenantSpec("noisy", args.quiet_rate * 10, **shape)
    cap, eng, dur = args.capacity, args.engines, args.duration
    share = args.tenant_share
    flow = _config(cap, True, tenant_share=share)
    alone = _scenario("quiet alone", flow, eng, [quiet], dur)
    both = [quiet, noisy]
    shared = _scenario(f"quiet + noisy (10x), vtc, tenant_share {share:g}", flow, eng, both, dur)
    unisolated = _scenario(
        f"quiet + noisy (10x), vtc, tenant_share {share:g}, prefill isolation off",
        _config(cap, True, tenant_share=share, prefill_isolation=False),
        eng,
        both,
        dur,
    )
    vtc = _scenario("quiet + noisy (10x), vtc", _config(cap, True), eng, both, dur)
    fifo = _scenario("quiet + noisy (10x), FIFO", _config(cap, False), eng, both, dur)
    base = alone[0]["ttft_p99_s"]
    return {
        "alone": alone,
        "vtc_share": shared,
        "vtc_share_no_isolation": unisolated,
        "vtc": vtc,
        "fifo": fifo,
        "quiet_p99_ratio_vtc_share": shared[0]["ttft_p99_s"] / base,
        "quiet_p99_ratio_vtc_share_no_isolation": unisolated[0]["ttft_p99_s"] / base,
        "quiet_p99_ratio_vtc": vtc[0]["ttft_p99_s"] / base,
        "quiet_p99_ratio_fifo": fifo[0]["ttft_p99_s"] / base,
    }


def priority(args: argparse.Namespace) -> dict[str, Any]:
    shape = {"prompt_tokens": args.prompt, "output_tokens": args.output}
    high = TenantSpec("high", args.quiet_rate, priority=1, **shape)
    low = TenantSpec("low", args.quiet_rate * 5, priority=0, **shape)
    shed = TenantSpec("sheddable", args.quiet_rate * 2, priority=-1, **shape)
    cap, eng, dur = args.capacity, args.engines, args.duration
    config = _config(cap, True, tenant_share=args.tenant_share, saturation={"queue_waiting": cap})
    alone = _scenario("high alone (unloaded)", config, eng, [high], dur)
    loaded = _scenario("high + low (5x) + sheddable (2x)", config, eng, [high, low, shed], dur)
    unisolated = _scenario(
        "high + low (5x) + sheddable (2x), prefill isolation off",
        {**config, "flow": {**config["flow"], "prefill_isolation": False}},
        eng,
        [high, low, shed],
        dur,
    )
    return {
        "alone": alone,
        "loaded": loaded,
        "loaded_no_isolation": unisolated,
        "high_p99_ratio": loaded[0]["ttft_p99_s"] / alone[0]["ttft_p99_s"],
        "high_p99_ratio_no_isolation": unisolated[0]["ttft_p99_s"] / alone[0]["ttft_p99_s"],
        "refused_by_band": {str(r["priority"]): r["refused"] for r in loaded},
    }


async def _hammer(urls: list[str], key: str, rate: float, seconds: float) -> list[int]:
    """Send ``rate`` requests per second through each URL for ``seconds``: statuses."""
    headers = {"Authorization": f"Bearer {key}"}
    body = {"prompt": "counted", "max_tokens": 1}
    async with aiohttp.ClientSession() as session:

        async def one(url: str) -> int:
            async with session.post(f"{url}/v1/completions", json=body, headers=headers) as r:
                await r.read()
                return r.status

        tasks = []
        started = time.monotonic()
        i = 0
        while time.monotonic() - started < seconds:
            for url in urls:
                tasks.append(asyncio.ensure_future(one(url)))
            i += 1
            await asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))
        return list(await asyncio.gather(*tasks))


def shared_limit(args: argparse.Namespace) -> dict[str, Any]:
    rpm, window = args.rpm, args.window
    server = RedisServer()
    try:
        config = _config(1000, True)
        config["flow"]["keys"] = [{"key": "k-bench", "name": "bench", "rpm": rpm}]
        config["flow"]["rate_limit"] = {
            "backend": "redis",
            "redis_url": server.url,
            "window_s": window,
        }
        with Fleet(1, config, replicas=2) as fleet:
            urls = [r.url for r in fleet.routers]
            per_replica = rpm / window  # each replica offered the whole limit: 2x in all
            statuses = asyncio.run(_hammer(urls, "k-bench", per_replica, window))
            passed = statuses.count(200)
            burst = max(1.0, rpm * 0.05)
            server.kill()
            # Each replica now offered twice the limit alone: its local buckets refuse half.
            after = asyncio.run(_hammer(urls, "k-bench", 2 * per_replica, min(window, 10.0)))
            fallbacks = 0.0
            for url in urls:
                text = asyncio.run(_text(f"{url}/metrics"))
                fallbacks += sum(
                    float(line.split()[-1])
                    for line in text.splitlines()
                    if line.startswith("kvroute_rate_limit_fallbacks_total")
                )
    finally:
        server.kill()
    result = {
        "rpm": rpm,
        "window_s": window,
        "offered": len(statuses),
        "passed": passed,
        "expected": rpm + burst,
        "error": passed / (rpm + burst) - 1,
        "redis_stopped": {
            "passed": after.count(200),
            "refused": after.count(429),
            "fallbacks": fallbacks,
        },
    }
    print(
        f"\nshared rpm {rpm} over {window:g} s, 2 replicas offered {len(statuses)}: passed "
        f"{passed} (limit + burst {rpm + burst:g}, {result['error']:+.1%}); Redis stopped: "
        f"{after.count(200)} passed, {after.count(429)} refused, {fallbacks:g} fallbacks"
    )
    return result


async def _text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return await resp.text()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router.bench.flow", description=__doc__)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument(
        "--capacity", type=int, default=4, help="limits.max_inflight (the pool's capacity)"
    )
    parser.add_argument("--quiet-rate", type=float, default=4.0, help="quiet/high tenant req/s")
    parser.add_argument("--prompt", type=int, default=2000, help="prompt tokens per request")
    parser.add_argument("--output", type=int, default=8, help="output tokens per request")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per scenario")
    parser.add_argument(
        "--tenant-share",
        type=float,
        default=0.5,
        help="flow.tenant_share of the fairness and priority runs",
    )
    parser.add_argument("--rpm", type=int, default=300, help="the shared key's limit")
    parser.add_argument("--window", type=float, default=60.0, help="its window (s)")
    parser.add_argument("--only", choices=["fairness", "priority", "shared-limit"])
    parser.add_argument("--out", default="bench-results/flow.json")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"settings": vars(args)}
    if args.only in (None, "fairness"):
        results["fairness"] = fairness(args)
    if args.only in (None, "priority"):
        results["priority"] = priority(args)
    if args.only in (None, "shared-limit"):
        results["shared_limit"] = shared_limit(args)
    print()
    if "fairness" in results:
        f = results["fairness"]
        print(
            f"quiet TTFT p99 / alone: vtc with tenant_share "
            f"{f['quiet_p99_ratio_vtc_share']:.2f}x (prefill isolation off "
            f"{f['quiet_p99_ratio_vtc_share_no_isolation']:.2f}x), vtc "
            f"{f['quiet_p99_ratio_vtc']:.2f}x, FIFO {f['quiet_p99_ratio_fifo']:.2f}x"
        )
    if "priority" in results:
        p = results["priority"]
        print(
            f"high TTFT p99 / unloaded: {p['high_p99_ratio']:.2f}x (prefill isolation off "
            f"{p['high_p99_ratio_no_isolation']:.2f}x); refused by band {p['refused_by_band']}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
