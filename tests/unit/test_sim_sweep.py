"""``kvroute simulate --sweep KEY=V1,V2,...``: one run per value of a key of the router
configuration's ``policy`` section, several flags running their cross product."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from router.cli import main
from router.config import PolicyConfig
from router.sim.cli import policy_variants

#: 16 requests of 4 shared 500-token prefixes on 2 engines: a fraction of a second each,
#: routed by kv_cost, whose weights the sweeps change.
WORKLOAD = [
    "simulate", "--workload", "shared-prefix", "--groups", "4", "--prompts-per-group", "4",
    "--prefix-tokens", "500", "--engines", "2", "--cache-blocks", "2048", "--quiet",
    "--policy", "kv_cost",
]  # fmt: skip

#: What differs between two runs of the same settings: their names, wall time and sweep.
NOT_METRICS = ("name", "wall_s", "sweep")


def results(tmp_path: Path, *flags: str) -> dict[str, Any]:
    """Run ``kvroute simulate`` on the tiny workload; its results.json."""
    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    assert main([*WORKLOAD, *flags, "--output", str(out)]) == 0
    document: dict[str, Any] = json.loads((out / "results.json").read_text())
    return document


def simulate(tmp_path: Path, *flags: str) -> list[dict[str, Any]]:
    """The runs of ``kvroute simulate`` on the tiny workload."""
    runs: list[dict[str, Any]] = results(tmp_path, *flags)["runs"]
    return runs


def metrics(run: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in run.items() if key not in NOT_METRICS}


def test_a_sweep_of_two_values_gives_two_named_runs_with_their_values(tmp_path: Path) -> None:
    document = results(tmp_path, "--sweep", "decode_weight=0.5,1")
    runs = document["runs"]
    assert [r["name"] for r in runs] == ["kv_cost decode_weight=0.5", "kv_cost decode_weight=1"]
    assert [r["sweep"] for r in runs] == [{"decode_weight": 0.5}, {"decode_weight": 1.0}]
    assert all(r["ok"] == 16 and r["policy"] == "kv_cost" for r in runs)
    assert document["baseline"] == "kv_cost decode_weight=0.5"  # the first run


def test_two_sweeps_run_their_cross_product(tmp_path: Path) -> None:
    runs = simulate(
        tmp_path,
        "--sweep",
        "policy.decode_weight=0,1",
        "--sweep",
        "latency.queue_model=backlog,tokens",
        "--baseline",
        "kv_cost decode_weight=1 latency.queue_model=backlog",
    )
    assert [r["name"] for r in runs] == [
        "kv_cost decode_weight=0 latency.queue_model=backlog",
        "kv_cost decode_weight=0 latency.queue_model=tokens",
        "kv_cost decode_weight=1 latency.queue_model=backlog",
        "kv_cost decode_weight=1 latency.queue_model=tokens",
    ]
    assert runs[3]["sweep"] == {"decode_weight": 1.0, "latency.queue_model": "tokens"}


def test_without_a_sweep_runs_record_no_sweep(tmp_path: Path) -> None:
    runs = simulate(tmp_path, "--policy", "round_robin")
    assert [r["name"] for r in runs] == ["kv_cost", "round_robin"]
    assert not any("sweep" in r for r in runs)


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("policy.nope=1", "policy.nope: Extra inputs are not permitted"),
        ("decode_weight=-1", "policy.decode_weight: Input should be greater than or equal to 0"),
        ("latency.itl_wieght=1", "did you mean itl_weight?"),
        ("latency.queue_model=fast", "policy.latency.queue_model: Input should be 'backlog'"),
        ("decode_weight.x=1", "policy.decode_weight is a value, not a section"),
        ("name=round_robin", "choose policies with --policy"),
    ],
)
def test_a_bad_key_or_value_is_refused(
    flag: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*WORKLOAD, "--sweep", flag, "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvroute simulate: --sweep") and message in err, err
    assert not (tmp_path / "results.json").exists()


def test_a_malformed_sweep_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("decode_weight", "decode_weight=", "decode_weight=1,,2", "decode_weight=1,1"):
        with pytest.raises(SystemExit) as exit_:
            main([*WORKLOAD, "--sweep", flag])
        assert exit_.value.code == 2
        assert "argument --sweep" in capsys.readouterr().err


def test_the_same_key_swept_twice_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--sweep", "decode_weight=0", "--sweep", "policy.decode_weight=1"]
    assert main([*WORKLOAD, *flags]) == 2
    assert "decode_weight: the key is swept twice" in capsys.readouterr().err


def test_sweeping_the_default_value_changes_nothing(tmp_path: Path) -> None:
    """decode_weight's default swept is the run without a sweep, number for number (the
    variant is the policy section the run routes with, and nothing else changes)."""
    assert PolicyConfig().decode_weight == 0.25
    (plain,) = simulate(tmp_path)
    (swept,) = simulate(tmp_path, "--sweep", "decode_weight=0.25")
    assert swept["name"] == "kv_cost decode_weight=0.25"
    assert metrics(swept) == metrics(plain)


def test_different_values_route_differently(tmp_path: Path) -> None:
    """No decode cost keeps each prefix group on its engine; 50 block-equivalents per
    decoding block spreads the groups by load, losing prefix hits."""
    together, spread = simulate(tmp_path, "--sweep", "decode_weight=0,50")
    assert together["decisions"] != spread["decisions"] or together["engines"] != spread["engines"]
    assert together["hit_rate"] > spread["hit_rate"]
    assert together["request_imbalance"] != spread["request_imbalance"]


def test_variants_keep_the_rest_of_the_configured_section() -> None:
    base = PolicyConfig(prefill_weight=3.0, latency={"itl_weight": 0.5})  # type: ignore[arg-type]
    variants = policy_variants(
        base,
        [
            ("latency.tpot_base_ms", ("latency", "tpot_base_ms"), [("1e1", "1e1"), ("7", 7)]),
            ("disk_weight", ("disk_weight",), [("null", None)]),
        ],
    )
    assert [label for label, _, _ in variants] == [
        " latency.tpot_base_ms=1e1 disk_weight=null",
        " latency.tpot_base_ms=7 disk_weight=null",
    ]
    first = variants[0][1]
    assert first.prefill_weight == 3.0 and first.latency.itl_weight == 0.5
    assert first.latency.tpot_base_ms == 10.0 and first.disk_weight is None
    # The swept values as validated (YAML reads 1e1 as a string; the model as 10.0).
    assert variants[0][2] == {"latency.tpot_base_ms": 10.0, "disk_weight": None}
    assert base.disk_weight == 0.25  # the configured section is left alone
