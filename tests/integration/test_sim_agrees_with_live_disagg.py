"""The simulator plans disaggregated requests as the live router does: same workload,
same engine model, the same plan code (:class:`router.plan.Planner`).

Two prefill and two decode emulated engines behind a real ``kvroute serve`` (real HTTP,
real ZMQ KV events, the NIXL handoff) against the simulator with the same engine
parameters and the same engine names. Requests go one at a time with the simulator's
request ids, so every decision sees the same index and load in both runs (ties, broken
by a hash of the request id and the engine name, break alike). Engine-reported load is
left out of the decode choice in both: it is as old as the last scrape, a matter of
timing, not of the plan.

The workload mixes groups whose later prompts the decode engine mostly holds (served
there alone: ``local:decode_hit``) with groups whose prompts differ after a short
prefix (split again, the prefill engine holding the prefix preferred).
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from support.clients import session
from support.engines import TEST_PARAMS, poll, start_test_engine
from support.routers import start_router

from router.config import DisaggregationConfig, PolicyConfig
from router.emulator import EmulatedEngine
from router.sim.cluster import ClusterSim, Fleet, SimSettings
from router.workloads.spec import RequestSpec

#: Share of requests whose plan (mode, decode engine, prefill engine) may differ.
TOLERANCE = 0.1
#: Engine-reported load off in the decode choice (see the module docstring).
DISAGGREGATION = {
    "decode_kv_usage_weight": 0.0,
    "decode_waiting_weight": 0.0,
    "decode_running_weight": 0.0,
}

Planned = tuple[str, str, str | None]
"""(mode, decode engine, prefill engine) of one request."""


def workload() -> list[RequestSpec]:
    rng = random.Random(20)
    specs = []

    def words(n: int, tag: str) -> str:
        return " ".join(f"{tag}{rng.randrange(10**6)}" for _ in range(n))

    for g in range(3):  # a long shared prefix, short questions: later ones stay local
        prefix = words(700, f"held{g}x")
        specs += [RequestSpec(f"{prefix} {words(30, 'q')}", max_tokens=4) for _ in range(4)]
    for g in range(3):  # a short shared prefix, long questions: each one splits
        prefix = words(200, f"split{g}x")
        specs += [RequestSpec(f"{prefix} {words(600, 'q')}", max_tokens=4) for _ in range(4)]
    rng.shuffle(specs)
    return specs


async def live_plans(engines: list[EmulatedEngine], specs: list[RequestSpec]) -> list[Planned]:
    app = await start_router(
        [{"url": e.url, "role": e.config.role} for e in engines],
        disaggregation=DISAGGREGATION,
    )
    plans: list[Planned] = []
    try:
        await poll(lambda: app.subscriber and app.subscriber.stats.replays["ok"] == len(engines))
        async with session() as http:
            for i, spec in enumerate(specs):
                async with http.post(
                    f"{app.url}/v1/completions",
                    json={"prompt": spec.prompt, "max_tokens": spec.max_tokens},
                    headers={"x-request-id": f"sim-{i}"},
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
                    mode = resp.headers["x-kvroute-mode"]
                    plans.append(
                        (
                            mode.split(":", 1)[0],
                            resp.headers["x-kvroute-engine"],
                            resp.headers.get("x-kvroute-prefill"),
                        )
                    )
    finally:
        await app.stop()
    return plans


def simulated_plans(endpoints: list[str], specs: list[RequestSpec]) -> list[Planned]:
    settings = SimSettings(
        Fleet(prefill=2, decode=2),
        TEST_PARAMS,
        PolicyConfig(),
        DisaggregationConfig(**DISAGGREGATION),
        concurrency=1,
    )
    run = asyncio.run(ClusterSim(settings, endpoints=endpoints).run(specs))
    assert not run.errors and len(run.records) == len(specs)
    # one at a time: the records' arrival order is the workload's, ids sim-0, sim-1, ...
    return [(r.mode, r.engine, r.prefill_engine) for r in run.records]


def split_share(plans: list[Planned]) -> float:
    return sum(mode == "split" for mode, _, _ in plans) / len(plans)


async def test_simulated_disaggregated_plans_match_a_live_router(ipc_dir: Path) -> None:
    engines = [
        await start_test_engine(
            engine_id=f"pd-agree-{role}{i}",
            role=role,
            kv_events_endpoint=f"ipc://{ipc_dir}/pd-agree-{role}{i}",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
            **({"handoff_failure": "error"} if role == "decode" else {}),
        )
        for role in ("prefill", "decode")
        for i in range(2)
    ]
    specs = workload()
    try:
        live = await live_plans(engines, specs)
    finally:
        for engine in engines:
            await engine.stop()
    endpoints = [f"127.0.0.1:{e.port}" for e in engines]
    loop = asyncio.get_running_loop()
    simulated = await loop.run_in_executor(None, simulated_plans, endpoints, specs)

    # both runs split and keep local the same requests, on the same pairs
    assert 0.3 < split_share(live) < 0.9, live  # the workload exercises both modes
    assert abs(split_share(live) - split_share(simulated)) <= TOLERANCE, (live, simulated)
    differing = [i for i, (a, b) in enumerate(zip(live, simulated, strict=True)) if a != b]
    assert len(differing) <= TOLERANCE * len(specs), [(live[i], simulated[i]) for i in differing]
    used = {(d, p) for mode, d, p in live if mode == "split"}
    assert len(used) > 1, live  # more than one pair was chosen: the choice was tested
