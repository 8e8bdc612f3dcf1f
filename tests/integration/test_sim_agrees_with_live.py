"""The simulator predicts what the live router does: same workload, same engine model.

Four in-process emulated engines behind a real ``kvroute serve`` (real HTTP, real ZMQ
KV events) against the simulator with the same engine parameters, for the default
policy and round robin. Tolerance: the hit rates agree within 5 points, and both
runs order the policies the same way.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from support.clients import REQUEST_TIMEOUT_S
from support.engines import TEST_PARAMS, poll, start_test_engine
from support.routers import start_router

from router.bench import report
from router.bench.runner import run_target
from router.config import PolicyConfig
from router.sim.cluster import ClusterSim, Fleet, SimSettings
from router.workloads.generated import shared_prefix_workload
from router.workloads.spec import RequestSpec

TOLERANCE = 0.05


def workload() -> list[RequestSpec]:
    # 8 groups of 6 prompts sharing a 1,200-token prefix; a 1,024-block cache per engine
    # holds about a dozen prefixes, so where a group's prompts go decides the hit rate.
    return shared_prefix_workload(8, 6, 1_200, 40, 16, seed=11)


async def live_hit_rate(policy: str, ipc_dir: Path) -> float:
    engines = [
        await start_test_engine(
            engine_id=f"agree-{policy}-{i}",
            kv_events_endpoint=f"ipc://{ipc_dir}/agree-{policy}-{i}",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
        )
        for i in range(4)
    ]
    urls = [e.url for e in engines]
    app = await start_router(urls, policy={"name": policy})
    try:
        await poll(lambda: app.subscriber and app.subscriber.stats.replays["ok"] == 4)
        run = await run_target(
            policy, f"policy:{policy}", app.url, urls, workload(), concurrency=4,
            sample_interval=0.5, quiet=True, timeout=REQUEST_TIMEOUT_S,
        )  # fmt: skip
    finally:
        await app.stop()
        for engine in engines:
            await engine.stop()
    summary = report.summarize_run(run)
    assert summary["errors"] == 0
    return float(summary["hit_rate"])


def simulated_hit_rate(policy: str) -> float:
    settings = SimSettings(Fleet(engines=4), TEST_PARAMS, PolicyConfig(name=policy), concurrency=4)
    run = asyncio.run(ClusterSim(settings).run(workload()))
    return float(run.summary()["hit_rate"])


async def test_simulated_hit_rates_and_policy_order_match_a_live_run(ipc_dir: Path) -> None:
    live = {p: await live_hit_rate(p, ipc_dir) for p in ("kv_cost", "round_robin")}
    loop = asyncio.get_running_loop()
    simulated = {
        p: await loop.run_in_executor(None, simulated_hit_rate, p)
        for p in ("kv_cost", "round_robin")
    }
    for policy in live:
        assert abs(live[policy] - simulated[policy]) <= TOLERANCE, (live, simulated)
    assert live["kv_cost"] > live["round_robin"]
    assert simulated["kv_cost"] > simulated["round_robin"]
