"""The workload kvroute bench builds from its flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from router.bench.cli import add_arguments, median_summary, round_order
from router.workloads.flags import TRACE_MAX_IN_FLIGHT, build_workload

TRACE = Path(__file__).parent.parent / "fixtures" / "traces" / "mooncake-small.jsonl"


def flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--target", "policy:kv_cost", *argv])


def test_a_trace_replays_on_its_compressed_timestamps_and_says_its_scale() -> None:
    workload = build_workload(flags("--workload", str(TRACE), "--scale", "0.25", "--speedup", "2"))
    assert [s.at for s in workload.specs] == [0.0, 0.125, 0.5, 1.25]
    assert workload.concurrency == TRACE_MAX_IN_FLIGHT
    assert "prompt lengths x0.25 (128-token blocks" in workload.description
    assert "blocks reusable with an infinite cache: 33.3%" in workload.description
    assert workload.info["scale"] == 0.25


@pytest.mark.parametrize(("prompt_format", "said"), [("tokens", "token ids"), ("text", "text")])
def test_a_trace_says_how_its_prompts_are_sent_once(prompt_format: str, said: str) -> None:
    workload = build_workload(flags("--workload", str(TRACE), "--prompt-format", prompt_format))
    assert f"mean 928 tokens, sent as {said})" in workload.description
    assert "tokens, tokens" not in workload.description


def test_closed_loop_ignores_timestamps() -> None:
    workload = build_workload(
        flags("--workload", str(TRACE), "--concurrency", "2", "--duration", "0.5")
    )
    assert len(workload.specs) == 4  # --duration bounds sending time, not arrivals
    assert all(s.at is None for s in workload.specs)
    assert workload.concurrency == 2


def test_limits_and_output_caps_apply_to_traces() -> None:
    workload = build_workload(
        flags("--workload", str(TRACE), "--requests", "2", "--max-output-tokens", "5")
    )
    assert [s.max_tokens for s in workload.specs] == [5, 1]


def test_a_chat_workload_counts_every_turn() -> None:
    workload = build_workload(flags("--workload", "chat", "--conversations", "3", "--turns", "4"))
    assert len(workload.specs) == 3
    assert workload.total == 12
    assert workload.concurrency == 8


def test_a_samples_workload_sends_each_prompt_n_times_in_a_row() -> None:
    workload = build_workload(
        flags(
            "--workload", "samples", "--groups", "3", "--prompts-per-group", "5",
            "--prefix-tokens", "40", "--output-spread", "0.25",
        )
    )  # fmt: skip
    assert workload.total == len(workload.specs) == 15
    assert len({s.prompt for s in workload.specs[:5]}) == 1
    assert workload.specs[5].prompt != workload.specs[4].prompt
    assert "3 prompts of 40 tokens, each sampled 5 times" in workload.description
    assert "(+-25%)" in workload.description


def test_rounds_interleave_the_targets_turning_the_order_each_round() -> None:
    assert round_order(["a", "b", "c"], 1) == [(0, "a"), (0, "b"), (0, "c")]
    assert round_order(["a", "b", "c"], 3) == [
        (0, "a"), (0, "b"), (0, "c"),
        (1, "c"), (1, "b"), (1, "a"),
        (2, "a"), (2, "b"), (2, "c"),
    ]  # fmt: skip


def test_rounds_are_summarised_by_each_numbers_median() -> None:
    rounds = [
        {"name": "kvroute", "ok": 10, "hit_rate": 0.5, "ttft_s": {"p99": 3.0}, "note": "x"},
        {"name": "kvroute", "ok": 12, "hit_rate": 0.7, "ttft_s": {"p99": 1.0}, "note": "y"},
        {"name": "kvroute", "ok": 11, "hit_rate": 0.2, "ttft_s": {"p99": 2.0}, "note": "z"},
    ]
    merged = median_summary(rounds)
    assert merged == {
        "name": "kvroute", "ok": 11, "hit_rate": 0.5, "ttft_s": {"p99": 2.0}, "note": "x"
    }  # fmt: skip
    assert median_summary(rounds[:1]) is rounds[0]


def test_rounds_must_be_a_whole_number_above_zero() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--target", "policy:kv_cost", "--rounds", "3"]).rounds == 3
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--target", "policy:kv_cost", "--rounds", bad])
