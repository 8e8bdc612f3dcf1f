"""The simulator with several router replicas (issue 29): each replica has its own index,
load view and policy; decisions reach the peers ``sync_delay_s`` late, and in-flight load
every ``load_interval_s`` and, with ``load_push``, each change ``sync_delay_s`` late."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest

from router.cli import main
from router.config import PolicyConfig
from router.engine_model import EngineParams
from router.sim.cluster import ClusterSim, Fleet, SimRun, SimSettings
from router.workloads.generated import chat_workload, shared_prefix_workload
from router.workloads.spec import RequestSpec

PARAMS = EngineParams(num_gpu_blocks=4_096, max_model_len=16_384)


def simulate(
    specs: list[RequestSpec], fleet: Fleet, policy: str = "kv_cost", **changes: object
) -> SimRun:
    settings = SimSettings(fleet, PARAMS, PolicyConfig(name=policy), **changes)  # type: ignore[arg-type]
    return asyncio.run(ClusterSim(settings).run(specs))


def bursts(
    groups: int = 16, per: int = 8, every: float = 0.02, gap: float = 0.0
) -> list[RequestSpec]:
    """``groups`` bursts of ``per`` prompts sharing a 2,000-token prefix, each burst's
    prompts ``gap`` apart (default: at one moment), a burst every ``every`` seconds
    (they overlap: the engines are still prefilling the last ones, so load weighs in
    every choice)."""
    specs = shared_prefix_workload(groups, per, 2_000, 20, 8, seed=1, shuffle=False)
    for n, spec in enumerate(specs):
        spec.at = (n // per) * every + (n % per) * gap
    return specs


def kept_together(run: SimRun) -> int:
    """Bursts whose prompts were all served by one engine."""
    engines: dict[str, set[str]] = {}
    for r in run.records:
        engines.setdefault(r.group, set()).add(r.engine)
    return sum(len(used) == 1 for used in engines.values())


def test_one_replica_is_the_single_router_whatever_the_replica_settings() -> None:
    """replicas=1 takes the single router's path: the sync delay, load interval and
    replica pick change nothing, down to every record."""
    default = simulate(shared_prefix_workload(8, 6, 1_200, 40, 16, seed=3), Fleet(engines=4))
    one = simulate(
        shared_prefix_workload(8, 6, 1_200, 40, 16, seed=3),
        Fleet(engines=4),
        replicas=1,
        sync_delay_s=0.5,
        load_interval_s=0.001,
        replica_pick="round_robin",
    )
    assert len(default.records) == 48
    assert one.records == default.records
    assert one.decisions == default.decisions
    split = one.summary()["replica_split"]
    assert split["pairs_across"] == 0 and split["across"] is None
    assert split["pairs_within"] > 0  # the single router's pairs: the baseline


def test_a_huge_sync_delay_splits_bursts_across_replicas() -> None:
    """A replica that never hears of its peer's decisions sends a burst's next prompt
    wherever its own view says, not to the engine its peer just chose."""
    synced = simulate(bursts(), Fleet(engines=4), replicas=2, sync_delay_s=0.0)
    apart = simulate(bursts(), Fleet(engines=4), replicas=2, sync_delay_s=1_000.0)
    a, b = synced.summary(), apart.summary()
    assert a["replica_split"]["pairs_across"] == b["replica_split"]["pairs_across"] >= 20
    assert a["replica_split"]["across"] <= 0.1
    assert b["replica_split"]["across"] >= 0.5
    assert kept_together(apart) < kept_together(synced)
    assert b["hit_rate"] < a["hit_rate"]


def test_synced_replicas_keep_bursts_together_as_one_router_does() -> None:
    """With no sync delay and an exchange of load every millisecond, each replica's index
    is the single router's and its load view nearly so. Two things still differ: without
    the load push, the prompts a peer routes at the same instant count in the load only
    from the next exchange, and each replica orders otherwise equal engines by its own
    routing count.
    Either can turn a close choice, so one burst in the 16 may differ; a replica that
    never hears of its peer's decisions (the last run) loses far more than that."""
    fleet = Fleet(engines=4)
    one = kept_together(simulate(bursts(), fleet))
    for replicas in (2, 4):
        many = kept_together(simulate(bursts(), fleet, replicas=replicas, load_interval_s=0.001))
        assert many >= one - 1, replicas
    unsynced = kept_together(simulate(bursts(), fleet, replicas=2, sync_delay_s=1_000.0))
    assert unsynced < one - 1


def test_a_peers_load_counts_from_the_next_exchange_or_when_its_change_arrives() -> None:
    """Replica 0 routes a long request at t=0; replica 1 routes short probes (round robin
    alternates the replicas). Through the exchange alone (no load push), until the
    exchange at 0.5 s replica 1 sees two idle engines and breaks the tie by request id,
    so some probes land beside the long request; from then on it sees that engine busy
    and none does. Exchanging every millisecond, none ever does. With the changes sent
    on the stream (``load_push``), replica 1 sees the long request one sync delay after
    it was sent, whatever the exchange's interval."""

    def workload() -> list[RequestSpec]:
        specs = [RequestSpec(prompt=list(range(10_000, 10_064)), max_tokens=400, at=0.0)]
        for k in range(20):
            prompt = list(range(20_000 + 100 * k, 20_016 + 100 * k))
            specs.append(RequestSpec(prompt=prompt, max_tokens=1, at=0.03 + 0.04 * k))
        return specs

    def probes_beside_the_long_one(
        interval: float, push: bool = False, delay: float = 0.0
    ) -> tuple[int, int]:
        run = simulate(
            workload(),
            Fleet(engines=2),
            "least_loaded",
            replicas=2,
            replica_pick="round_robin",
            load_interval_s=interval,
            load_push=push,
            sync_delay_s=delay,
            scrape_interval_s=1_000.0,  # engine-reported load stays that of t=0: idle
        )
        long = next(r for r in run.records if r.output_tokens == 400)
        assert long.replica == 0
        probes = [r for r in run.records if r.output_tokens == 1 and r.replica == 1]
        assert len(probes) == 10
        seen = min(interval, delay) if push else interval
        before = sum(r.engine == long.engine for r in probes if r.arrival < seen)
        after = sum(r.engine == long.engine for r in probes if r.arrival >= seen)
        return before, after

    before, after = probes_beside_the_long_one(0.5)
    assert before >= 1 and after == 0
    assert probes_beside_the_long_one(0.001) == (0, 0)
    assert probes_beside_the_long_one(0.5, push=True) == (0, 0)
    before, after = probes_beside_the_long_one(5.0, push=True, delay=0.3)
    assert before >= 1 and after == 0


def test_conversation_turns_stay_on_their_engine_with_unsynced_replicas() -> None:
    """A follow-up turn arrives after the previous one finished, when the engine's KV
    events have reached every replica: even replicas that never share a decision send it
    back to the engine holding the conversation."""

    def run(**changes: object) -> SimRun:
        specs = chat_workload(16, 4, 300, 30, 20, seed=2)
        return simulate(specs, Fleet(engines=4), concurrency=8, **changes)

    one = run().summary()
    apart = run(replicas=2, sync_delay_s=1_000.0).summary()
    assert one["follow_up_turns"] == apart["follow_up_turns"] == 48
    assert one["turn_stickiness"] >= 0.9
    assert apart["turn_stickiness"] >= one["turn_stickiness"] - 0.05
    traces_have_no_turns = simulate(bursts(2, 2), Fleet(engines=2)).summary()
    assert traces_have_no_turns["turn_stickiness"] is None


def test_a_decision_record_reaches_the_peers_with_what_is_left_of_its_ttl() -> None:
    """A delay longer than the provisional ttl (5 s) is the same as never syncing: the
    record expires on the way. One shorter than the gap between a burst's prompts is as
    good as none."""
    fleet = Fleet(engines=4)

    def engines(delay: float) -> list[str]:
        run = simulate(bursts(gap=0.004), fleet, replicas=2, sync_delay_s=delay)
        return [r.engine for r in run.records]

    never = engines(1_000.0)
    assert engines(6.0) == never
    assert engines(0.002) == engines(0.0) != never


@pytest.mark.parametrize(
    "changes",
    [
        {"replicas": 0},
        {"sync_delay_s": -0.1},
        {"load_interval_s": 0.0},
        {"replica_pick": "sticky"},
        {"group_prefix_tokens": 0},
    ],
)
def test_bad_replica_settings_are_refused(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(SimSettings(Fleet(engines=2), PARAMS), **changes)  # type: ignore[arg-type]


def test_kvroute_simulate_sweeps_sync_delays_side_by_side(tmp_path: Path) -> None:
    code = main(
        [
            "simulate", "--workload", "shared-prefix", "--groups", "4", "--prompts-per-group",
            "4", "--prefix-tokens", "1100", "--engines", "2", "--cache-blocks", "2048",
            "--replicas", "1,2", "--sync-delay-ms", "0,500", "--load-interval-ms", "50",
            "--output", str(tmp_path), "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    document = json.loads((tmp_path / "results.json").read_text())
    runs = document["runs"]
    assert [r["name"] for r in runs] == [
        "latency x1",
        "latency x2 sync=0ms",
        "latency x2 sync=500ms",
    ]
    assert [(r["replicas"], r["sync_delay_s"]) for r in runs] == [(1, None), (2, 0.0), (2, 0.5)]
    assert runs[1]["load_interval_s"] == 0.05
    assert all(r["ok"] == 16 for r in runs)
    assert "replica split rate" in (tmp_path / "summary.md").read_text()


def test_kvroute_simulate_refuses_no_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--workload", "shared-prefix", "--replicas", "2,0"])
    assert "at least one replica" in capsys.readouterr().err
