"""``make bench-aiconfigurator``'s own code: calibrating kvroute's engine model from
AIConfigurator's estimates and reading its verdicts. None of it needs AIConfigurator."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from router.bench.aiconfigurator import (
    Point,
    calibrate,
    calibration_flags,
    dense_weight_bytes,
    least_squares,
    plan_argv,
    read_verdict,
    start_rate,
    table_rows,
)
from router.engine_model.flags import add_model_arguments, engine_params

QWEN3_32B = {"layers": 64, "n": 64, "n_kv": 8, "d": 128, "hidden_size": 5120}
QWEN3_32B |= {"inter_size": 25600, "vocab": 151936}
H200 = {
    "gpu": {"mem_capacity": 151397597184},
    "node": {"intra_node_bw": 450e9},
    "misc": {"other_mem": 3758096384},
}


def probe_of(overhead_ms: float, per_seq_ms: float, per_ctx_ms: float, per_token_ms: float):
    """Estimates that follow kvroute's step formula exactly."""
    return {
        "prefill": [[n, overhead_ms + n * per_token_ms] for n in (256, 1024, 4096, 8192)],
        "decode": [
            [b, c, overhead_ms + b * per_seq_ms + b * c * per_ctx_ms]
            for b in (1, 8, 64, 256)
            for c in (1000, 8000)
        ],
        "model": QWEN3_32B,
        "system": H200,
    }


def test_least_squares_recovers_an_exact_line() -> None:
    rows = [[1.0, x, x * x] for x in (0.0, 1.0, 2.0, 5.0)]
    assert least_squares(rows, [3 + 2 * x - x * x for _, x, _ in rows]) == pytest.approx(
        [3.0, 2.0, -1.0]
    )


def test_calibration_recovers_the_step_formula_it_was_built_from() -> None:
    settings = calibrate(probe_of(18.0, 0.03, 6e-5, 0.1))
    assert settings["step_overhead_ms"] == pytest.approx(18.0)
    assert settings["decode_us_per_seq"] == pytest.approx(30.0)
    assert settings["decode_ns_per_context_token"] == pytest.approx(60.0)
    assert settings["prefill_us_per_token"] == pytest.approx(100.0)
    # K and V of 64 layers x 8 KV heads x 128 dims in 16 bits.
    assert settings["kv_bytes_per_token"] == 262_144
    assert settings["kv_transfer_bandwidth"] == 450e9


def test_cache_is_what_the_weights_leave_of_the_gpu() -> None:
    weights = dense_weight_bytes(QWEN3_32B)
    assert 64e9 < weights < 67e9  # Qwen3-32B in BF16 is about 65.5 GB
    blocks = calibrate(probe_of(18.0, 0.03, 6e-5, 0.1))["cache_blocks"]
    free = 151397597184 * 0.9 - weights - 3758096384
    assert blocks == int(free // (262_144 * 16))


def test_calibration_flags_are_engine_model_flags() -> None:
    flags = calibration_flags(calibrate(probe_of(18.0, 0.03, 6e-5, 0.1)))
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    params = engine_params(parser.parse_args(flags))
    assert params.step_overhead_s == pytest.approx(0.018)
    assert params.prefill_token_s == pytest.approx(100e-6)
    assert params.kv_bytes_per_token == 262_144
    assert params.kv_transfer_bandwidth == 450e9


def _csv(path: Path, header: list[str], row: list[str]) -> None:
    path.parent.mkdir(parents=True)
    path.write_text(",".join(header) + "\n" + ",".join(row) + "\n")


def test_read_verdict_takes_the_best_of_each_kind(tmp_path: Path) -> None:
    run = tmp_path / "Qwen" / "run"
    _csv(
        run / "agg" / "best_config_topn.csv",
        ["tokens/s/gpu", "tp", "pp", "ttft", "tpot"],
        ["669.4", "2", "1", "490.1", "46.8"],
    )
    _csv(
        run / "disagg" / "best_config_topn.csv",
        ["tokens/s/gpu", "(p)tp", "(d)tp", "(p)workers", "(d)workers", "ttft", "tpot"],
        ["520.4", "1", "4", "4", "1", "778.1", "17.7"],
    )
    verdict = read_verdict(tmp_path)
    assert verdict["winner"] == "aggregated"
    assert verdict["agg_over_disagg"] == pytest.approx(669.4 / 520.4)
    assert verdict["agg"]["shape"] == "4 x tp2"
    assert verdict["disagg"]["prefill_gpus"] == 4 and verdict["disagg"]["decode_gpus"] == 4
    assert verdict["disagg"]["shape"] == "1 x (4 x tp1 P + 1 x tp4 D)"


def test_a_kind_without_configurations_loses(tmp_path: Path) -> None:
    _csv(
        tmp_path / "x" / "disagg" / "best_config_topn.csv",
        ["tokens/s/gpu", "(p)tp", "(d)tp", "(p)workers", "(d)workers", "ttft", "tpot"],
        ["100", "1", "1", "2", "6", "900", "20"],
    )
    verdict = read_verdict(tmp_path)
    assert verdict["agg"] is None and verdict["winner"] == "disaggregated"


def test_table_row_per_point() -> None:
    plan = {"winner": "aggregated", "colocated_over_split": 1.5, "best_split": "5P+3D"}
    result = {
        "point": {"isl": 4000, "osl": 500, "ttft_ms": 1000, "tpot_ms": 50},
        "aic": {
            "winner": "aggregated",
            "agg_over_disagg": 1.29,
            "agg": {"shape": "4 x tp2"},
            "disagg": {"shape": "1 x (4 x tp1 P + 1 x tp4 D)", "prefill_gpus": 4, "decode_gpus": 4},
        },
        "plan_default": plan,
        "plan_calibrated": plan | {"winner": "disaggregated", "colocated_over_split": 0.8},
    }
    rows = table_rows([result])
    assert rows[1][:3] == ["4,000 / 500", "1000 / 50 ms", "agg (1.29x)"]
    assert rows[1][4] == "1 x (4 x tp1 P + 1 x tp4 D) (4:4)"
    assert rows[1][5:] == ["agg (1.50x)", "5P+3D", "disagg (0.80x)", "5P+3D"]


def test_plan_argv_asks_for_unique_prompts_of_the_point() -> None:
    argv = plan_argv(Point(8000, 200, 3000, 20, ""), 80, 2.5, ["--cache-blocks", "100"])
    assert argv[argv.index("--rate") + 1] == "2.5"
    assert argv[argv.index("--prefix-tokens") + 1] == "7984"
    assert argv[argv.index("--question-tokens") + 1] == "16"
    assert argv[argv.index("--prompts-per-group") + 1] == "1"
    assert argv[argv.index("--itl-slo-ms") + 1] == "20"
    assert argv[-2:] == ["--cache-blocks", "100"]


def test_search_starts_at_half_the_prefill_capacity() -> None:
    # 8 GPUs, 0.5 s of prefill per request: 16 requests/s at most, start at 8.
    assert start_rate(Point(4_000, 500, 1000, 50, ""), 0.1, 100e-6) == 8.0
