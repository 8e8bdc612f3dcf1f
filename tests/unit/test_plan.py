"""``kvroute plan``: goodput search over prefill:decode splits of a GPU budget."""

from __future__ import annotations

import json
import re
from array import array
from pathlib import Path

import pytest

from router.cli import main
from router.engine_model import EngineParams
from router.sim.capacity import (
    Slo,
    at_rate,
    base_rate,
    candidate_fleets,
    poisson_arrivals,
    search_rate,
)
from router.sim.cluster import Fleet, RequestRecord, SimRun, SimSettings
from router.workloads.spec import RequestSpec


def run_of(*latencies: tuple[float, float]) -> SimRun:
    """A run whose requests had these (TTFT, e2e) with 11 output tokens each."""
    records = [
        RequestRecord(0.0, 100, 11, 0, "e", None, "aggregated", "x", ttft, e2e)
        for ttft, e2e in latencies
    ]
    settings = SimSettings(Fleet(engines=1), EngineParams())
    return SimRun("t", settings, records, array("d"), [], 0.0, {}, 0, 0)


def test_a_request_counts_only_when_it_meets_both_targets() -> None:
    slo = Slo(ttft_s=1.0, itl_s=0.05, attainment=0.9)
    # ITL is (e2e - ttft) / 10: 0.04, 0.06, 0.04
    run = run_of((0.5, 0.9), (0.5, 1.1), (1.5, 1.9))
    assert slo.met(run) == pytest.approx(1 / 3)


def test_the_search_finds_the_largest_rate_within_the_slos() -> None:
    slo = Slo(1.0, 1.0, 0.9)
    limit = 5.3  # attainment falls below 90% above this factor

    def evaluate(factor: float) -> tuple[float, SimRun]:
        return (1.0 if factor <= limit else 0.5), run_of((0.1, 0.2))

    factor, attainment, run, runs = search_rate(evaluate, slo, 1.0, steps=8)
    assert limit / 1.02 <= factor <= limit
    assert attainment == 1.0 and run is not None
    assert runs <= 4 + 8


def test_the_search_brackets_downwards_and_gives_up_below_its_limit() -> None:
    slo = Slo(1.0, 1.0, 0.9)
    factor, *_ = search_rate(lambda f: ((1.0 if f <= 0.3 else 0.0), run_of()), slo, 1.0, 4)
    assert 0.25 <= factor <= 0.3
    nothing = search_rate(lambda f: (0.0, run_of()), slo, 1.0, 4)
    assert nothing[0] == 0.0 and nothing[2] is None


def test_candidate_fleets_divide_the_budget() -> None:
    assert candidate_fleets(3) == [
        Fleet(engines=3),
        Fleet(prefill=1, decode=2),
        Fleet(prefill=2, decode=1),
    ]
    assert candidate_fleets(2, colocated=False) == [Fleet(prefill=1, decode=1)]


def test_rates_scale_arrival_times() -> None:
    specs = poisson_arrivals([RequestSpec(prompt="a") for _ in range(2_001)], 4.0, seed=1)
    assert base_rate(specs) == pytest.approx(4.0, rel=0.1)
    assert base_rate(at_rate(specs, 2.0)) == pytest.approx(2 * base_rate(specs))


def test_kvroute_plan_recommends_a_fleet(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "plan", "--workload", "shared-prefix", "--groups", "6", "--prompts-per-group", "4",
            "--prefix-tokens", "1500", "--output-tokens", "32", "--gpus", "2",
            "--ttft-slo-ms", "400", "--itl-slo-ms", "40", "--search-steps", "2",
            "--cache-blocks", "4096", "--quiet",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "recommended: " in out
    for fleet in ("2 colocated", "1P+1D"):
        assert fleet in out
    assert out.count("\nfleet ") == 1  # one table: it fits in 100 columns


def test_kvroute_plan_sweeps_request_shapes(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "plan", "--sweep-lengths", "--gpus", "2", "--prompt-lengths", "128", "4096",
            "--output-lengths", "50", "--sweep-requests", "60", "--sweep-seconds", "5",
            "--search-steps", "2",
            "--ttft-slo-ms", "1000", "--itl-slo-ms", "30", "--quiet",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "split/colocated" in out
    assert (
        len([line for line in out.splitlines() if line.lstrip().startswith(("128", "4,096"))]) == 2
    )


def test_kvroute_plan_refuses_a_bad_attainment(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--attainment", "1.5"]) == 2
    assert "--attainment" in capsys.readouterr().err


def test_kvroute_plan_sweeps_split_thresholds(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "plan", "--sweep-threshold", "--fleet", "1P+1D", "--workload", "shared-prefix",
            "--groups", "4", "--prompts-per-group", "3", "--prefix-tokens", "1000",
            "--thresholds", "0", "1000000000", "--search-steps", "1", "--cache-blocks", "4096",
            "--quiet",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [line.split() for line in out.splitlines() if line.startswith(("0 ", "never "))]
    assert [row[0] for row in rows] == ["0", "never"]
    # Never splitting leaves the split share at 0%.
    assert rows[1][2] == "0%"


def test_the_threshold_sweep_needs_a_disaggregated_fleet(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["plan", "--sweep-threshold", "--fleet", "4", "--workload", "shared-prefix"])
    assert code == 2
    assert "needs a prefill/decode fleet" in capsys.readouterr().err


def test_kvroute_plan_writes_its_table_with_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "plan", "--workload", "shared-prefix", "--groups", "4", "--prompts-per-group", "3",
            "--prefix-tokens", "1000", "--output-tokens", "32", "--gpus", "2", "--no-colocated",
            "--ttft-slo-ms", "400", "--itl-slo-ms", "40", "--search-steps", "1",
            "--cache-blocks", "4096", "--quiet", "--output", str(tmp_path / "plan"),
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    document = json.loads((tmp_path / "plan" / "results.json").read_text())
    assert document["recommended"] == "1P+1D"
    (row,) = document["table"]
    assert row["fleet"] == "1P+1D" and float(row["goodput req/s"]) > 0
    assert "| fleet | goodput req/s |" in (tmp_path / "plan" / "summary.md").read_text()


def test_every_column_of_a_plan_table_is_labelled(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "plan", "--sweep-threshold", "--fleet", "1P+1D", "--workload", "shared-prefix",
            "--groups", "4", "--prompts-per-group", "3", "--prefix-tokens", "1000",
            "--thresholds", "0", "--search-steps", "1", "--cache-blocks", "4096", "--quiet",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    rule = next(i for i, line in enumerate(lines) if set(line) <= {"-", " "} and "--" in line)
    header, dashes = lines[rule - 1], lines[rule]
    # Under every run of dashes, a label above it.
    for start, end in ((m.start(), m.end()) for m in re.finditer(r"-+", dashes)):
        assert header[start:end].strip(), (header, dashes)
