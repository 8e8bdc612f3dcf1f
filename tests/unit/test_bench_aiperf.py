"""``make bench-aiperf``'s own code: the tokenizer laid out as a Hugging Face cache
entry, the trace file AIPerf replays, and reading AIPerf's results. None of it needs
AIPerf installed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from router.bench.aiperf import (
    MODEL,
    agreement_rows,
    aiperf_rows,
    bench_summary,
    corpus_words,
    hf_cache_entry,
    hit_rate,
    parse_export,
    trace_lines,
    word_tokenizer_files,
)
from router.bench.runner import EngineSnapshot
from router.tokenization.words import WordTokenizer
from router.workloads.expansion import PromptExpander
from router.workloads.traces import TraceRequest, parse_mooncake

TEXT = "From fairest creatures we desire increase , That thereby beauty's rose might never die"


def test_cache_entry_has_the_layout_the_hub_resolves_offline(tmp_path: Path) -> None:
    files = word_tokenizer_files(corpus_words(TEXT))
    snapshot = hf_cache_entry(tmp_path, MODEL, files)

    repo = tmp_path / "hub" / "models--kvroute--emulated-words"
    revision = (repo / "refs" / "main").read_text()
    assert re.fullmatch(r"[0-9a-f]{40}", revision)
    assert snapshot == repo / "snapshots" / revision
    assert sorted(p.name for p in snapshot.iterdir()) == [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    hub = pytest.importorskip("huggingface_hub")
    found = hub.try_to_load_from_cache(MODEL, "tokenizer.json", cache_dir=tmp_path / "hub")
    assert found == str(snapshot / "tokenizer.json")


def test_same_files_same_revision_changed_files_new_one(tmp_path: Path) -> None:
    first = hf_cache_entry(tmp_path, MODEL, word_tokenizer_files(["a", "b"]))
    again = hf_cache_entry(tmp_path, MODEL, word_tokenizer_files(["a", "b"]))
    other = hf_cache_entry(tmp_path, MODEL, word_tokenizer_files(["a", "c"]))
    assert first == again
    assert other != first
    assert (tmp_path / "hub/models--kvroute--emulated-words/refs/main").read_text() == other.name


def test_repo_id_must_be_org_slash_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ORG/NAME"):
        hf_cache_entry(tmp_path, "no-org", {"config.json": "{}"})


def test_one_token_per_emulator_word_and_decoding_keeps_the_words() -> None:
    files = word_tokenizer_files(corpus_words(TEXT))
    tok = Tokenizer.from_str(files["tokenizer.json"])
    text = "we desire increase , never die unheard-of"
    ids = tok.encode(text).ids
    assert len(ids) == WordTokenizer().count(text)
    assert ids[-1] == 0  # unknown words are [UNK], still one token
    known = tok.encode("That thereby beauty's rose").ids
    assert tok.decode(known) == "That thereby beauty's rose"
    config = json.loads(files["tokenizer_config.json"])
    assert "bos_token" not in config and "eos_token" not in config


def test_trace_lines_match_what_bench_sends() -> None:
    requests = [
        TraceRequest(0.0, 1_000, 300, (1, 2)),
        TraceRequest(0.125, 1_500, 20, (1, 2, 3)),
    ]
    expander = PromptExpander(512, 0.0625)
    lines = trace_lines(requests, expander, max_output_tokens=128)
    records = [json.loads(line) for line in lines]
    assert [r["timestamp"] for r in records] == [0, 125]
    assert [r["input_length"] for r in records] == [expander.length(r) for r in requests]
    assert [r["output_length"] for r in records] == [128, 20]
    # One hash id per 32-token block, as AIPerf's --isl-block-size 32 expects.
    parsed = list(parse_mooncake(lines, block_tokens=expander.block_len))
    assert [p.hash_ids for p in parsed] == [(1, 2), (1, 2, 3)]


def test_parse_export_reads_seconds_rates_and_errors() -> None:
    document = {
        "time_to_first_token": {"unit": "ms", "avg": 200.0, "p50": 150.0, "p90": 400, "p99": 900},
        "inter_token_latency": {"unit": "ms", "avg": 8.0, "p50": 7.0, "p90": 9.0, "p99": 30.0},
        "request_latency": {"unit": "ms", "avg": 1000.0, "p50": 900.0, "p99": 2000.0},
        "request_throughput": {"unit": "requests/sec", "avg": 20.5},
        "output_token_throughput": {"unit": "tokens/sec", "avg": 2000.0},
        "request_count": {"unit": "requests", "avg": 38.0},
        "overall_usage_prompt_cache_read_pct": {"unit": "%", "avg": 12.5},
        "error_summary": [{"error_details": {"code": 500}, "count": 2}],
    }
    out = parse_export(document)
    assert out["time_to_first_token"] == {"mean": 0.2, "p50": 0.15, "p90": 0.4, "p99": 0.9}
    assert out["request_latency"]["p90"] is None
    assert out["inter_chunk_latency"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert out["requests"] == 38 and out["errors"] == 2
    assert out["request_throughput"] == 20.5
    assert out["hit_rate_client"] == 0.125


def test_hit_rate_sums_deltas_over_engines() -> None:
    before = [EngineSnapshot(0, queries=100, hits=10), EngineSnapshot(0, queries=0, hits=0)]
    after = [EngineSnapshot(1, queries=300, hits=60), EngineSnapshot(1, queries=200, hits=50)]
    assert hit_rate(before, after) == pytest.approx(100 / 400)
    assert hit_rate(before, [after[0], EngineSnapshot(1, ok=False)]) is None


def test_bench_summary_adds_the_per_request_mean_itl() -> None:
    target = {
        "ok": 2,
        "errors": 0,
        "hit_rate": 0.5,
        "ttft_s": {"mean": 0.1, "p50": 0.1, "p90": 0.1, "p99": 0.1},
        "results": [
            {"status": 200, "ttft": 0.1, "e2e": 1.1, "completion_tokens": 11},
            {"status": 200, "ttft": 0.2, "e2e": 0.2, "completion_tokens": 1},
            {"status": 500, "ttft": None, "e2e": 0.3, "completion_tokens": 0},
        ],
    }
    summary = bench_summary(target)
    assert summary["inter_token_latency"]["p50"] == pytest.approx(0.1)
    aiperf = {"requests": 2, "errors": 0, "hit_rate": 0.25, "time_to_first_token": {"p50": 0.2}}
    rows = agreement_rows({"kvroute": aiperf}, {"kvroute": summary})
    assert rows[0] == ["metric", "kvroute AIPerf", "kvroute bench", "AIPerf/bench"]
    hit = next(r for r in rows if r[0] == "prefix-cache hit rate (engines)")
    assert hit[1:] == ["25.0%", "50.0%", "0.50x"]
    ttft = next(r for r in rows if r[0] == "TTFT p50")
    assert ttft[1:] == ["200.0 ms", "100.0 ms", "2.00x"]


def test_aiperf_rows_divide_by_the_baseline() -> None:
    runs = {
        "kvroute": {"hit_rate": 0.3, "time_to_first_token": {"mean": 0.1}},
        "rr": {"hit_rate": 0.1, "time_to_first_token": {"mean": 0.2}},
    }
    rows = aiperf_rows(runs, "rr")
    assert rows[0] == ["metric", "kvroute", "rr", "kvroute/rr"]
    assert next(r for r in rows if r[0] == "TTFT mean")[1:] == ["100.0 ms", "200.0 ms", "0.50x"]
    assert next(r for r in rows if r[0].startswith("prefix-cache"))[3] == "3.00x"
