"""kvroute bench end to end: a router in front of two emulated engines, and the CLI."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from support.clients import REQUEST_TIMEOUT_S, metric, metrics
from support.engines import poll, start_test_engine
from support.routers import start_router

from router.bench import report
from router.bench.loadgen import run_load
from router.bench.runner import run_target
from router.cli import main
from router.emulator import EmulatedEngine
from router.workloads.expansion import PromptExpander, trace_specs
from router.workloads.generated import chat_workload
from router.workloads.spec import spec_tokens
from router.workloads.traces import read_trace, select

TRACE = Path(__file__).parent.parent / "fixtures" / "traces" / "mooncake-small.jsonl"


@pytest_asyncio.fixture
async def pair(ipc_dir: Path) -> AsyncIterator[list[EmulatedEngine]]:
    engines = [
        await start_test_engine(
            engine_id=f"bench{i}",
            kv_events_endpoint=f"ipc://{ipc_dir}/bench{i}",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
        )
        for i in range(2)
    ]
    yield engines
    for engine in engines:
        await engine.stop()


async def test_the_report_matches_the_engines_own_metrics(
    pair: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    urls = [e.url for e in pair]
    app = await start_router(urls)
    try:
        await poll(lambda: app.subscriber and app.subscriber.stats.replays["ok"] == 2)
        trace = read_trace(TRACE)
        specs = list(trace_specs(select(trace.requests, speedup=10), PromptExpander(scale=0.25)))
        specs += chat_workload(3, 2, 64, 20, 8, seed=2)
        run = await run_target(
            "kvroute", "policy:kv_cost", app.url, urls, specs, concurrency=8,
            sample_interval=0.05, quiet=True, timeout=REQUEST_TIMEOUT_S,
        )  # fmt: skip
    finally:
        await app.stop()
    summary = report.summarize_run(run)
    assert summary["errors"] == 0
    assert summary["ok"] == len(specs) + 3  # every conversation's second turn too

    queries = hits = finished = ttft = e2e = 0.0
    for engine, reported in zip(pair, summary["engines"], strict=True):
        samples = await metrics(http, engine.url)
        q = metric(samples, "vllm:prefix_cache_queries_total")
        h = metric(samples, "vllm:prefix_cache_hits_total")
        n = metric(samples, "vllm:e2e_request_latency_seconds_count")
        ttft += metric(samples, "vllm:time_to_first_token_seconds_sum")
        e2e += metric(samples, "vllm:e2e_request_latency_seconds_sum")
        # Fresh engines: their totals are exactly what the run did.
        assert reported["queried_tokens"] == q
        assert reported["hit_tokens"] == h
        assert reported["requests"] == n
        queries, hits, finished = queries + q, hits + h, finished + n
    assert finished == summary["ok"]
    assert summary["hit_rate"] == hits / queries
    assert summary["hit_rate"] > 0
    prompt = sum(r.prompt_tokens for r in run.results)
    assert prompt == queries
    assert summary["hit_rate_client"] == summary["hit_rate"]
    assert 0 < summary["hit_rate"] <= summary["ceiling"] + 1e-9
    assert summary["ttft_s"]["p50"] > 0
    assert len(summary["timeseries"]["t"]) >= 2
    # The engines' own view: their histograms, over the run.
    assert summary["engine_ttft_mean_s"] == pytest.approx(ttft / finished)
    assert summary["engine_decode_mean_s"] == pytest.approx((e2e - ttft) / finished)
    # (In the engines' model time: these run faster than the clock, so the client's
    # seconds are not comparable here; bench runs engines on the clock.)
    assert summary["engine_ttft_mean_s"] > 0 and summary["engine_decode_mean_s"] > 0
    assert summary["decode_s"]["mean"] > 0


async def test_a_second_turn_carries_the_first_answer_and_hits_it(
    pair: list[EmulatedEngine],
) -> None:
    urls = [e.url for e in pair]
    app = await start_router(urls)
    try:
        await poll(lambda: app.subscriber and app.subscriber.stats.replays["ok"] == 2)
        run = await run_target(
            "kvroute", "policy:kv_cost", app.url, urls, chat_workload(1, 2, 100, 30, 24),
            concurrency=1, quiet=True, timeout=REQUEST_TIMEOUT_S,
        )  # fmt: skip
    finally:
        await app.stop()
    first, second = run.results
    assert first.ok and second.ok
    assert second.spec.messages is not None
    assert second.spec.messages[2] == {"role": "assistant", "content": first.text}
    assert len(first.text.split()) == 24
    assert second.engine == first.engine
    # Everything the engine computed for turn 1 (prompt + answer but its last token).
    computed = len(spec_tokens(first.spec)) + 24 - 1
    assert second.cached_tokens == computed // 16 * 16


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_chat_workload_runs_on_the_responses_api_and_hits_its_cache(
    stream: bool, pair: list[EmulatedEngine]
) -> None:
    urls = [e.url for e in pair]
    app = await start_router(urls)
    try:
        await poll(lambda: app.subscriber and app.subscriber.stats.replays["ok"] == 2)
        first, second = await run_load(
            app.url, chat_workload(1, 2, 100, 30, 24), concurrency=1, stream=stream,
            api="responses", timeout=REQUEST_TIMEOUT_S,
        )  # fmt: skip
    finally:
        await app.stop()
    assert first.ok and second.ok, (first.error, second.error)
    assert len(first.text.split()) == 24 and first.completion_tokens == 24
    assert first.prompt_tokens == len(spec_tokens(first.spec))
    assert second.engine == first.engine
    assert second.cached_tokens >= first.prompt_tokens // 16 * 16 > 0


def test_bench_compare_starts_engines_and_routers_and_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    status = main(
        [
            "bench",
            "--engines", "2",
            "--engine-args", "--time-scale 0.01 --cache-blocks 2048",
            "--compare", "kv=policy:kv_cost", "rr=policy:round_robin",
            "--workload", str(TRACE),
            "--scale", "0.25",
            "--speedup", "20",
            "--sample-interval", "0.1",
            "--rounds", "2",
            "--output", str(out),
            "--timeout", str(REQUEST_TIMEOUT_S),
            "--quiet",
        ]
    )  # fmt: skip
    assert status == 0
    document = json.loads((out / "results.json").read_text())
    assert [t["name"] for t in document["targets"]] == ["kv", "rr"]
    # Two interleaved rounds, each on fresh engines; the table's numbers are their medians.
    assert {name: len(runs) for name, runs in document["rounds"].items()} == {"kv": 2, "rr": 2}
    assert all(run["ok"] == 4 for runs in document["rounds"].values() for run in runs)
    for target in document["targets"]:
        assert target["ok"] == 4
        assert target["errors"] == 0
        assert len(target["engines"]) == 2
        assert sum(e["requests"] for e in target["engines"]) == 4
    assert document["workload"]["block_tokens"] == 128
    assert document["workload"]["oracle_block_hit_rate"] > 0
    summary = (out / "summary.md").read_text()
    assert "| metric | better | kv | rr | rr/kv |" in summary
    assert "| TTFT p50 | lower |" in summary and "ratios: a target's value over kv's" in summary
    for name in ("ttft_cdf.png", "engine_load.png", "hit_rate.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")


def test_an_external_router_command_is_started_with_the_engines_and_stopped(
    tmp_path: Path,
) -> None:
    """The cmd: extension point, with kvroute serve standing in for a peer router."""
    out = tmp_path / "out"
    command = (
        f"{sys.executable} -m router serve --host {{host}} --port {{port}} --engine {{engines}}"
    )
    status = main(
        [
            "bench",
            "--engines", "1",
            "--engine-args", "--time-scale 0.01",
            "--target", f"cmd:{command}",
            "--workload", "chat", "--conversations", "2", "--turns", "2",
            "--system-tokens", "50", "--question-tokens", "10", "--output-tokens", "4",
            "--output", str(out),
            "--timeout", str(REQUEST_TIMEOUT_S),
            "--no-plots",
            "--quiet",
        ]
    )  # fmt: skip
    assert status == 0
    (target,) = json.loads((out / "results.json").read_text())["targets"]
    assert target["name"] == "command"
    assert target["ok"] == 4
    assert target["engines"][0]["requests"] == 4
    assert not list(out.glob("*.png"))


def _exits_at_once(status: int) -> str:
    return f"cmd:{sys.executable} -c 'import sys; sys.exit({status})' {{host}} {{port}}"


def test_a_peer_that_fails_to_start_is_recorded_and_the_others_still_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A failing target (here the baseline) costs only its own column."""
    out = tmp_path / "out"
    status = main(
        [
            "bench",
            "--engines", "1",
            "--engine-args", "--time-scale 0.01",
            "--compare", f"broken={_exits_at_once(3)}", "kv=policy:kv_cost",
            "--workload", "chat", "--conversations", "2", "--turns", "2",
            "--system-tokens", "50", "--question-tokens", "10", "--output-tokens", "4",
            "--output", str(out),
            "--timeout", str(REQUEST_TIMEOUT_S),
            "--no-plots",
            "--quiet",
        ]
    )  # fmt: skip
    assert status == 0
    printed = capsys.readouterr()
    assert "target broken failed:" in printed.err
    assert "exited with status 3" in printed.err
    assert "baseline broken failed; ratios are to kv" in printed.err
    assert "failed    broken:" in printed.out
    document = json.loads((out / "results.json").read_text())
    assert [t["name"] for t in document["targets"]] == ["kv"]
    assert document["targets"][0]["ok"] == 4
    assert document["baseline"] == "kv"
    assert document["baseline_requested"] == "broken"
    (failure,) = document["failed"]
    assert failure["name"] == "broken"
    assert failure["spec"].startswith("cmd:")
    assert "exited with status 3" in failure["reason"]
    summary = (out / "summary.md").read_text()
    assert "| metric | better | kv |" in summary
    assert "Failed (no results): broken:" in summary


def test_bench_exits_non_zero_when_no_target_produced_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    status = main(
        [
            "bench",
            "--engine-url", "http://127.0.0.1:9",
            "--compare", f"a={_exits_at_once(1)}", f"b={_exits_at_once(2)}",
            "--workload", "chat", "--conversations", "1", "--turns", "1",
            "--output", str(out),
            "--quiet",
        ]
    )  # fmt: skip
    assert status == 1
    err = capsys.readouterr().err
    assert "target a failed:" in err and "target b failed:" in err
    assert "no target answered a request" in err
    document = json.loads((out / "results.json").read_text())
    assert document["targets"] == []
    assert document["baseline"] is None
    assert [f["name"] for f in document["failed"]] == ["a", "b"]
    assert not list(out.glob("*.png"))
