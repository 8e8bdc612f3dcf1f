"""The cluster simulator: the router's decision code against engine models, virtual clock."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from router.cli import main
from router.config import DisaggregationConfig, PolicyConfig
from router.engine_model import EngineParams
from router.sim.cli import parse_fleet
from router.sim.cluster import ClusterSim, Fleet, Layout, SimRun, SimSettings
from router.workloads.generated import chat_workload, shared_prefix_workload
from router.workloads.spec import RequestSpec

PARAMS = EngineParams(num_gpu_blocks=4_096, max_model_len=16_384)


def simulate(
    specs: list[RequestSpec],
    fleet: Fleet,
    policy: str = "kv_cost",
    **changes: object,
) -> SimRun:
    settings = SimSettings(fleet, PARAMS, PolicyConfig(name=policy), **changes)  # type: ignore[arg-type]
    return asyncio.run(ClusterSim(settings).run(specs))


def timed(specs: list[RequestSpec], gap: float) -> list[RequestSpec]:
    for i, spec in enumerate(specs):
        spec.at = i * gap
    return specs


def groups(n: int = 8, per: int = 6, prefix: int = 1_000) -> list[RequestSpec]:
    return shared_prefix_workload(n, per, prefix, 40, 16, seed=3)


def test_the_same_workload_gives_the_same_run_every_time() -> None:
    a = simulate(groups(), Fleet(engines=4), concurrency=4)
    b = simulate(groups(), Fleet(engines=4), concurrency=4)
    assert [(r.engine, r.ttft, r.cached_tokens) for r in a.records] == [
        (r.engine, r.ttft, r.cached_tokens) for r in b.records
    ]
    assert len(a.records) == 48


def test_kv_cost_keeps_groups_together_and_beats_round_robin() -> None:
    kv = simulate(groups(), Fleet(engines=4), "kv_cost", concurrency=4).summary()
    rr = simulate(groups(), Fleet(engines=4), "round_robin", concurrency=4).summary()
    # Round robin hits only where a group comes back to an engine it already visited.
    assert kv["hit_rate"] > 1.5 * rr["hit_rate"]
    assert 0.95 * kv["ceiling"] <= kv["hit_rate"] <= kv["ceiling"] + 1e-9
    assert kv["ttft_s"]["mean"] < rr["ttft_s"]["mean"]
    assert all(e["requests"] > 0 for e in kv["engines"])


def test_a_run_reports_the_routers_index_memory() -> None:
    """Issue 24: the simulator says what the router's index holds at the end of a run
    and what it takes (the index and the event streams' maps, by sys.getsizeof)."""
    summary = simulate(groups(), Fleet(engines=4), concurrency=4).summary()
    memory = summary["router_index"]
    cached_blocks = 8 * 1_000 // PARAMS.block_size  # each group's prefix, at least once
    assert memory["entries"] >= cached_blocks
    # Every entry costs its key, a slot in two dicts and an engine-hash map entry.
    assert 80 <= memory["bytes_per_entry"] <= 1_000
    assert memory["bytes"] == round(memory["entries"] * memory["bytes_per_entry"])


def test_a_burst_follows_the_first_decision_before_any_kv_event() -> None:
    # All six requests of one group arrive together: the provisional holder recorded by
    # the first decision draws the others to the same engine.
    specs = [
        RequestSpec(prompt=s.prompt, max_tokens=4, at=0.0)
        for s in shared_prefix_workload(1, 6, 1_000, 10, 4, seed=1)
    ]
    run = simulate(specs, Fleet(engines=4), event_lag_s=10.0)
    assert len({r.engine for r in run.records}) == 1


def test_engines_without_kv_events_are_tracked_from_decisions() -> None:
    kv = simulate(groups(), Fleet(engines=4), events=False, concurrency=4).summary()
    rr = simulate(groups(), Fleet(engines=4), "round_robin", events=False, concurrency=4)
    assert kv["hit_rate"] > 1.5 * rr.summary()["hit_rate"]


def test_long_prompts_are_split_and_their_kv_moves_to_the_decode_engine() -> None:
    specs = timed(groups(4, 3, 2_000), 0.05)
    run = simulate(specs, Fleet(prefill=2, decode=2))
    first = {}
    for r in run.records:
        first.setdefault(r.group, r)
    # A group's first prompt is split; later ones are split unless their decode engine
    # already holds the prefix (the first one's KV was pulled there).
    assert {r.mode for r in first.values()} == {"split"}
    assert {r.reason for r in run.records if r.mode == "local"} <= {"decode_holds_prefix"}
    assert all(r.prefill_engine.startswith("sim-prefill-") for r in run.records if r.prefill_engine)
    assert all(r.engine.startswith("sim-decode-") for r in run.records)
    summary = run.summary()
    assert summary["split_share"] >= 4 / 12
    assert summary["decisions"]["kv_cost:no_prefix"] >= 1


def test_a_decode_leg_frees_the_prefill_engines_hold() -> None:
    specs = timed(groups(2, 2, 2_000), 0.05)
    sim = ClusterSim(SimSettings(Fleet(prefill=1, decode=1), PARAMS))
    run = asyncio.run(sim.run(specs))
    assert any(r.mode == "split" for r in run.records)
    prefill, decode = (e.model.stats() for e in sim.engines)
    assert prefill.num_held_requests == 0 and prefill.num_expired_holds == 0
    assert decode.kv_transferred_tokens > 0


def test_short_prompts_are_served_by_the_decode_engine_alone() -> None:
    specs = timed(shared_prefix_workload(2, 3, 100, 20, 8, seed=2), 0.05)
    run = simulate(specs, Fleet(prefill=1, decode=2))
    assert {r.mode for r in run.records} == {"local"}
    assert {r.reason for r in run.records} <= {"short_uncached", "decode_holds_prefix"}
    assert run.summary()["engines"][0]["prefill_tokens"] == 0  # the prefill engine idled


def test_a_split_costs_the_transfer_time_in_ttft() -> None:
    specs = timed([RequestSpec(prompt=[1_000 + i for i in range(4_000)], max_tokens=2)], 1.0)
    fast = simulate(specs, Fleet(prefill=1, decode=1))
    slow_link = PARAMS.replace(kv_transfer_bandwidth=1e9)
    settings = SimSettings(Fleet(prefill=1, decode=1), slow_link, PolicyConfig())
    slow = asyncio.run(ClusterSim(settings).run(timed(specs, 1.0)))
    # 4,000 tokens x 128 KiB at 1 GB/s: about half a second more than at 50 GB/s.
    added = slow.records[0].ttft - fast.records[0].ttft
    assert added == pytest.approx(4_000 * 131_072 * (1 / 1e9 - 1 / 50e9), rel=0.05)


def test_a_layout_places_pools_packed_per_rack_or_apart() -> None:
    roles = ["prefill"] * 2 + ["decode"] * 2
    packed = Layout(2, "packed").place(roles)
    spread = Layout(2, "spread").place(roles)
    assert [t.rack for t in packed] == ["rack-0", "rack-1", "rack-0", "rack-1"]
    assert [t.rack for t in spread] == ["rack-0", "rack-0", "rack-1", "rack-1"]
    assert len({t.node for t in packed}) == 4 and {t.zone for t in packed} == {"zone-0"}
    with pytest.raises(ValueError, match="layout"):
        Layout(2, "diagonal")


def test_packed_pools_transfer_inside_their_rack_and_spread_ones_cross_it() -> None:
    specs = timed(groups(4, 2, 2_000), 0.2)  # one request at a time: no load to trade
    packed = simulate(specs, Fleet(prefill=2, decode=2), layout=Layout(2, "packed"))
    spread = simulate(
        timed(groups(4, 2, 2_000), 0.2), Fleet(prefill=2, decode=2), layout=Layout(2, "spread")
    )
    assert packed.summary()["cross_rack_share"] == 0.0
    assert {r.link for r in packed.records if r.mode == "split"} == {"same_rack"}
    assert spread.summary()["cross_rack_share"] == 1.0
    assert spread.summary()["layout"] == "spread on 2 racks (25 GB/s uplinks)"
    # A rack's link is 50 GB/s, the spine's 12.5: the same splits start later.
    split = [i for i, r in enumerate(packed.records) if r.mode == "split"]
    assert all(spread.records[i].ttft > packed.records[i].ttft for i in split)


def test_transfers_crossing_a_rack_at_once_share_its_uplink() -> None:
    def burst() -> list[RequestSpec]:
        # Eight unique 4,000-token prompts at once: their transfers overlap.
        return timed(
            [
                RequestSpec(prompt=[50_000 * k + i for i in range(4_000)], max_tokens=2)
                for k in range(8)
            ],
            0.0,
        )

    fleet = Fleet(prefill=4, decode=4)
    wide = simulate(burst(), fleet, layout=Layout(2, "spread", uplink_gb_s=1_000.0))
    narrow = simulate(burst(), fleet, layout=Layout(2, "spread", uplink_gb_s=2.0))
    assert all(r.mode == "split" for r in wide.records + narrow.records)
    # 2 GB/s shared by up to 4 transfers per rack: each runs at a fraction of the spine's
    # 12.5 GB/s, and the one that crossed alone still ran at most at 2 GB/s.
    assert narrow.summary()["ttft_s"]["mean"] > wide.summary()["ttft_s"]["mean"]
    alone = 4_000 * 131_072 / 2e9
    assert min(r.ttft for r in narrow.records) > alone


def test_never_splitting_serves_everything_on_decode_engines() -> None:
    never = DisaggregationConfig(min_uncached_tokens=10**9)
    run = simulate(
        timed(groups(2, 3, 2_000), 0.05), Fleet(prefill=1, decode=1), disaggregation=never
    )
    assert {r.mode for r in run.records} == {"local"}


def test_a_prompt_longer_than_the_context_is_refused_and_the_run_goes_on() -> None:
    specs = groups(2, 2, 500)
    specs.insert(1, RequestSpec(prompt=list(range(1_000, 1_000 + 17_000)), max_tokens=4))
    sim = ClusterSim(SimSettings(Fleet(engines=2), PARAMS, concurrency=1))
    summary = asyncio.run(sim.run(specs)).summary()
    assert summary["ok"] == 4 and summary["errors"] == 1
    assert "maximum context length is 16384 tokens" in next(iter(summary["error_reasons"]))
    assert all(load.requests == 0 and load.prefill_tokens == 0 for load in sim.loads.view.values())


def test_chat_turns_follow_from_the_simulated_answers() -> None:
    specs = chat_workload(4, 3, 200, 20, 10, seed=5)
    run = simulate(specs, Fleet(engines=2), concurrency=2)
    assert len(run.records) == 12
    # Later turns repeat the conversation, answers included: hits near the ceiling.
    summary = run.summary()
    assert summary["hit_rate"] >= 0.9 * summary["ceiling"]


@pytest.mark.parametrize(
    ("text", "fleet"),
    [
        ("8", Fleet(engines=8)),
        ("2P+6D", Fleet(prefill=2, decode=6)),
        ("1p + 3d", Fleet(prefill=1, decode=3)),
    ],
)
def test_fleet_specs_parse(text: str, fleet: Fleet) -> None:
    assert parse_fleet(text) == fleet


@pytest.mark.parametrize("text", ["", "P+D", "2P", "8+2", "-1"])
def test_bad_fleet_specs_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_fleet(text)


def test_kvroute_simulate_compares_policies_and_writes_results(tmp_path: Path) -> None:
    code = main(
        [
            "simulate", "--workload", "shared-prefix", "--groups", "4", "--prompts-per-group",
            "4", "--prefix-tokens", "500", "--engines", "2", "--policy", "kv_cost",
            "--policy", "round_robin", "--cache-blocks", "2048", "--output", str(tmp_path),
            "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    document = json.loads((tmp_path / "results.json").read_text())
    names = [r["name"] for r in document["runs"]]
    assert names == ["kv_cost", "round_robin"]
    assert all(r["ok"] == 16 for r in document["runs"])
    assert "prefix-cache hit rate" in (tmp_path / "summary.md").read_text()


def test_kvroute_simulate_sends_at_most_requests_of_a_chat(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "simulate", "--workload", "chat", "--conversations", "4", "--turns", "3",
            "--system-tokens", "200", "--question-tokens", "20", "--output-tokens", "8",
            "--requests", "5", "--engines", "2", "--cache-blocks", "2048",
            "--output", str(tmp_path), "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    (run,) = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert run["ok"] == 5
    assert "the first 5 requests" in capsys.readouterr().out


def test_kvroute_simulate_of_every_policy_prints_its_table_within_100_columns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "simulate", "--workload", "shared-prefix", "--groups", "2", "--prompts-per-group",
            "2", "--prefix-tokens", "200", "--engines", "2", "--policy", "all",
            "--cache-blocks", "2048", "--output", str(tmp_path), "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith("metric ")]
    assert len(headers) > 1  # 8 policies and 7 ratios: wrapped
    height = lines.index("", headers[0]) - headers[0]  # each table has the same rows
    for start in headers:
        table = lines[start : start + height]
        assert max(len(line) for line in table) <= 100, table[0]


def test_kvroute_simulate_refuses_an_unknown_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--workload", "shared-prefix", "--policy", "fastest"]) == 2
    assert "unknown policy 'fastest'" in capsys.readouterr().err


def test_a_lone_request_runs_at_its_routing_floor() -> None:
    """The floor is the engine model's own arithmetic: one request on an idle fleet has
    exactly the floor's TTFT (its prefill in chunks of the step budget) and gaps."""
    spec = RequestSpec(prompt=list(range(100_000, 112_000)), max_tokens=20, at=0.0)
    run = simulate([spec], Fleet(engines=2))
    floor = run.summary()["floor"]
    (record,) = run.records
    assert record.output_tokens == 20
    assert record.ttft == pytest.approx(floor["ttft_mean_s"], rel=1e-9)
    assert floor["ttft_mean_s"] == pytest.approx(
        2 * PARAMS.step_overhead_s + 12_000 * PARAMS.prefill_token_s
    )
    assert max(run.itl) == pytest.approx(floor["itl_mean_s"] * 2 - min(run.itl), rel=1e-9)
    # The same percentile as the run's own: every gap at its floor, so the same p99.
    assert run.summary()["itl_s"]["p99"] == pytest.approx(floor["itl_p99_s"], rel=1e-12)


@pytest.mark.parametrize("policy", ["kv_cost", "latency", "round_robin", "cache_aware_sglang"])
def test_no_policy_goes_below_the_routing_floor(policy: str) -> None:
    """Every policy's TTFT and inter-token figures are at or above the floor, which
    counts a shared prefix as cached for all but the first request of a group."""
    run = simulate(timed(groups(), 0.002), Fleet(engines=4), policy)
    s = run.summary()
    floor = s["floor"]
    assert s["ttft_s"]["mean"] >= floor["ttft_mean_s"] > 0
    assert s["ttft_s"]["p99"] >= floor["ttft_p99_s"]
    assert s["itl_s"]["p99"] >= floor["itl_p99_s"]
    assert s["itl_s"]["mean"] >= floor["itl_mean_s"]
    alone = [simulate([spec], Fleet(engines=1)).records[0].ttft for spec in timed(groups(), 0.002)]
    assert floor["ttft_mean_s"] < sum(alone) / len(alone)  # shared prefixes count as cached


def test_the_routing_floor_counts_only_what_an_earlier_request_computed() -> None:
    from router.sim.cluster import routing_floor

    params = EngineParams(
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=8,
        step_overhead_s=1.0,
        prefill_token_s=0.1,
        decode_seq_s=0.0,
        context_token_s=0.01,
    )
    first = ([1, 2, 3], 12, [])  # 12 tokens, 3 blocks: nothing cached
    second = ([1, 2, 9], 12, [])  # its first two blocks were computed: 4 tokens its own
    third = ([1, 2, 3], 12, [])  # all three blocks, but never the last token: 4 its own
    floor = routing_floor([first, second, third], [1, 3, 1], params)
    # 12 tokens in two chunks (2 steps): 2 + 1.2 s; then 4 tokens in one step: 1.4 s.
    assert floor["ttft_mean_s"] == pytest.approx((3.2 + 1.4 + 1.4) / 3)
    # The second request's two gaps decode over contexts 12 and 13.
    assert floor["itl_mean_s"] == pytest.approx(1.0 + 0.01 * 12.5)
    assert floor["itl_p99_s"] == pytest.approx(1.0 + 0.01 * 12.99)  # interpolated
    assert routing_floor([first], [1], params)["itl_p99_s"] is None


def test_a_disaggregated_fleet_has_no_routing_floor() -> None:
    """A decode engine holds blocks it received, which no step of it computed."""
    run = simulate(groups(2, 2), Fleet(prefill=1, decode=1))
    assert run.records and run.summary()["floor"] == {}
