"""The soak's report maths: which failures a fault explains, the per-minute table, the
verdict (router.bench.soak.report), and the strict sender's error labels."""

from __future__ import annotations

import json

import pytest

from router.bench.soak.fleet import fault_plan
from router.bench.soak.report import (
    FaultWindow,
    Outcome,
    RampStep,
    RouterSummary,
    Sample,
    SoakRun,
    attribute,
    client_cpu_percent,
    document,
    format_summary,
    format_table,
    format_verdict,
    judge,
    minute_rows,
    router_counters,
    summarize_logs,
)
from router.bench.soak.sender import error_label

RESTART = FaultWindow("engine restart", 100.0, 106.0, "127.0.0.1:9001")
REDIS = FaultWindow("redis restart", 200.0, 205.0, None)


def failed(
    sent: float, ended: float, engine: str = "", reason: str = "sse-502", status: int = 200
) -> Outcome:
    return Outcome(sent, "completion-stream", ended, status, engine, False, reason)


def answered(sent: float, latency: float) -> Outcome:
    return Outcome(sent, "completion", sent + latency, 200, "127.0.0.1:9002", True)


def test_a_failure_on_the_faulted_engine_during_its_fault_is_the_fault_s() -> None:
    assert attribute(failed(99.0, 100.5, "127.0.0.1:9001"), [RESTART]) == "engine restart"
    assert attribute(failed(112.0, 113.0, "127.0.0.1:9001"), [RESTART], grace=5) == ""


def test_a_failure_on_another_engine_or_during_a_redis_restart_is_unexplained() -> None:
    assert attribute(failed(101.0, 102.0, "127.0.0.1:9002"), [RESTART, REDIS]) == ""
    assert attribute(failed(201.0, 202.0, ""), [RESTART, REDIS]) == ""


def test_a_failure_naming_no_engine_during_an_engine_fault_is_the_fault_s() -> None:
    assert attribute(failed(101.0, 101.2, ""), [RESTART]) == "engine restart"


def test_a_router_error_or_a_500_is_never_excused() -> None:
    router_error = failed(101.0, 101.2, "", reason="http-503 router_error", status=503)
    internal = failed(101.0, 101.2, "127.0.0.1:9001", reason="http-500", status=500)
    assert attribute(router_error, [RESTART]) == ""
    assert attribute(internal, [RESTART]) == ""


def test_error_labels_name_the_status_or_the_sse_code_and_refuse_other_bodies() -> None:
    body = {"error": {"message": "m", "type": "bad_gateway", "code": 502}}
    assert error_label(body, 502) == "http-502"
    assert error_label(body) == "sse-502"
    worded = {"error": {"message": "m", "type": "service_unavailable", "code": "router_error"}}
    assert error_label(worded, 503) == "http-503 router_error"
    assert error_label({"detail": "Internal Server Error"}, 500) is None
    assert error_label({"error": "boom"}) is None


def test_minutes_count_requests_by_the_minute_they_were_sent() -> None:
    outcomes = [answered(1.0, 0.2), answered(59.9, 0.5), answered(61.0, 0.1)]
    outcomes += [failed(100.0, 101.0, "127.0.0.1:9001")]
    outcomes += [Outcome(110.0, "chat", 170.0, reason="client timeout", lost=True)]
    samples = [
        Sample(0.0, 100 * 1024, 0.0, 0.0, host_busy_s=0.0),
        Sample(60.0, 110 * 1024, 6.0, 24.0, host_busy_s=60.0),
        Sample(120.0, 121 * 1024, 18.0, 48.0, host_busy_s=120.0, index_outages=3),
    ]
    rows = minute_rows(outcomes, samples, [RESTART], 120.0, cores=2)
    assert [(r.sent, r.answered, r.failed, r.lost) for r in rows] == [(2, 2, 0, 0), (3, 1, 1, 1)]
    assert rows[1].reasons == {"lost": 1, "sse-502": 1}
    assert rows[0].faults == [] and rows[1].faults == ["engine restart"]
    assert rows[0].rss_mib == 110.0 and rows[1].rss_mib == 121.0
    assert rows[1].router_cpu == pytest.approx(20.0)  # 12 CPU-s in 60 s
    assert rows[1].soak_cpu == pytest.approx(20.0)  # 24 CPU-s in 60 s on 2 cores
    assert rows[1].host_cpu == pytest.approx(50.0)
    assert rows[1].index_outages == 3
    assert rows[1].p99_ms == pytest.approx(100.0)


def test_the_verdict_compares_memory_after_warm_up_with_the_last_minute() -> None:
    outcomes = [answered(60.0 * m + 1, 0.1) for m in range(4)]
    samples = [Sample(60.0 * m, int(rss * 1024), 0.0) for m, rss in enumerate((90, 100, 100, 112))]
    rows = minute_rows(outcomes, samples, [], 180.0)
    verdict = judge(outcomes, rows, [])
    assert verdict.rss_from == (2, 100.0) and verdict.rss_to == (3, 112.0)
    assert not verdict.memory_flat and verdict.no_loss and verdict.no_router_failure
    assert not verdict.passed
    assert format_verdict(verdict)[-1] == "verdict: FAIL"


def test_a_run_too_short_for_warm_up_compares_its_first_minute_with_its_last() -> None:
    outcomes = [answered(1.0, 0.1)]
    rows = minute_rows(outcomes, [Sample(30.0, 100 * 1024, 0.0)], [], 60.0)
    verdict = judge(outcomes, rows, [])
    assert verdict.rss_from == (1, 100.0) and verdict.rss_to == (1, 100.0)
    assert verdict.passed


def test_lost_and_unexplained_requests_fail_the_verdict_and_are_listed() -> None:
    outcomes = [answered(1.0, 0.1), failed(5.0, 6.0, "127.0.0.1:9002")]
    outcomes.append(Outcome(7.0, "chat", 9.0, reason="stream ended without [DONE]", lost=True))
    rows = minute_rows(outcomes, [Sample(60.0, 1024, 0.0)], [], 60.0)
    verdict = judge(outcomes, rows, [])
    assert (verdict.lost, verdict.failed, len(verdict.unexplained)) == (1, 1, 1)
    lines = format_verdict(verdict)
    assert lines[0].startswith("FAIL requests lost: 1 of 3")
    assert lines[1].startswith("FAIL failures the router caused: 1")
    assert any("unexplained" in line and "127.0.0.1:9002" in line for line in lines)


def test_the_table_is_markdown_with_one_row_per_minute() -> None:
    outcomes = [answered(1.0, 0.25), failed(2.0, 3.0, "127.0.0.1:9001")]
    rows = minute_rows(outcomes, [Sample(60.0, 2048, 0.0)], [RESTART], 60.0)
    lines = format_table(rows).splitlines()
    assert len(lines) == 3
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|")
    assert "| 1 (sse-502: 1) |" in lines[2]


def test_the_fault_plan_scales_with_the_run_and_bounds_the_stall() -> None:
    assert [(name, start) for name, start, _ in fault_plan(600.0)] == [
        ("engine restart", 150.0),
        ("redis restart", 270.0),
        ("engine stall", 390.0),
    ]
    assert fault_plan(600.0)[2][2] == 30.0
    assert fault_plan(60.0)[2][2] == 10.0


def test_router_counters_sum_over_engines_and_leave_out_zeroes() -> None:
    text = (
        "# TYPE kvroute_engine_ejections_total counter\n"
        'kvroute_engine_ejections_total{engine="a:1"} 2.0\n'
        'kvroute_engine_ejections_total{engine="b:2"} 1.0\n'
        "# TYPE kvroute_requests_total counter\n"
        'kvroute_requests_total{outcome="ok",route="chat",status="200"} 5.0\n'
        'kvroute_requests_total{outcome="stream_error",route="chat",status="502"} 0.0\n'
    )
    assert router_counters(text) == {
        "kvroute_engine_ejections_total": 3.0,
        'kvroute_requests_total{outcome="ok",route="chat",status="200"}': 5.0,
    }


def test_log_summary_groups_messages_by_shape_and_keeps_tracebacks() -> None:
    lines = [
        json.dumps({"level": "warning", "msg": "engine http://127.0.0.1:9001 ejected"}),
        json.dumps({"level": "warning", "msg": "engine http://127.0.0.1:9002 ejected"}),
        json.dumps({"level": "error", "msg": "unexpected error", "exc": "Traceback: boom"}),
        "not json",
    ]
    counts, tracebacks = summarize_logs("\n".join(lines))
    assert counts[0] == ("warning", "engine http://N.N.N.N:N ejected", 2)
    assert ("raw", "not json", 1) in counts
    assert tracebacks == ["Traceback: boom"]


def test_a_fault_that_ends_on_a_minute_boundary_is_not_in_the_next_minute() -> None:
    stall = FaultWindow("engine stall", 30.0, 60.0, "127.0.0.1:9001")
    rows = minute_rows([answered(1.0, 0.1)], [Sample(120.0, 1024, 0.0)], [stall], 120.0)
    assert [r.faults for r in rows] == [["engine stall"], []]


def a_run() -> SoakRun:
    run = SoakRun(capacity=50.0, rate=40.0, ramp=[RampStep(2, 50.0, 80.0, 0)], duration=60.0)
    run.outcomes = [
        answered(1.0, 0.25),
        Outcome(7.0, "chat", 9.0, reason="stream ended without [DONE]", lost=True),
    ]
    run.windows = [RESTART, REDIS]
    run.samples = [Sample(0.0, 1024, 0.0, client_cpu_s=1.0), Sample(10.0, 2048, 1.0, 0.0, 6.0)]
    run.pacer_lag_max_s = 0.012
    return run


def test_the_load_generator_s_cpu_is_over_the_run_in_percent_of_a_core() -> None:
    assert client_cpu_percent(a_run().samples) == pytest.approx(50.0)  # 5 CPU-s in 10 s
    assert client_cpu_percent([Sample(0.0, 1024, 0.0)]) == 0.0


def test_the_summary_names_the_load_each_fault_and_what_the_router_logged() -> None:
    router = RouterSummary(
        {"kvroute_retries_total": 3.0}, [("warning", "engine N down", 2)], ["Traceback: x"]
    )
    lines = format_summary(a_run(), router)
    assert lines[0] == (
        "capacity 50.0 answered/s, sent 40.0 requests/s; pacer lag at most 12 ms; "
        "load generator CPU 50% of a core; 0 requests unfinished"
    )
    assert lines[1] == "fault: engine restart on 127.0.0.1:9001 from 100.0 s to 106.0 s"
    assert lines[2] == "fault: redis restart from 200.0 s to 205.0 s"
    assert lines[3:] == [
        "router counters at the end:",
        "         3 kvroute_retries_total",
        "router log (warnings and errors, numbers elided):",
        "       2 warning: engine N down",
        "router traceback:\nTraceback: x",
    ]


def test_the_router_summary_reads_its_metrics_and_its_log() -> None:
    metrics = 'kvroute_retries_total{engine="a"} 2.0\nkvroute_retries_total{engine="b"} 1.0\n'
    log = json.dumps({"level": "error", "msg": "lost 12 bytes", "exc": "Traceback"})
    router = RouterSummary.of(metrics, log)
    assert router.counters == {"kvroute_retries_total": 3.0}
    assert router.logs == [("error", "lost N bytes", 1)]
    assert router.tracebacks == ["Traceback"]


def test_the_json_document_keeps_the_setup_every_request_and_the_verdict() -> None:
    run = a_run()
    rows = minute_rows(run.outcomes, run.samples, run.windows, run.duration)
    verdict = judge(run.outcomes, rows, run.windows)
    doc = document(run, rows, verdict, RouterSummary({}, [], []), {"command": "soak"})
    assert list(doc)[:2] == ["command", "capacity_answered_per_s"]
    assert doc["ramp"] == [{"concurrency": 2, "answered_per_s": 50.0, "p99_ms": 80.0, "failed": 0}]
    assert doc["requests"]["rows"][1] == [
        7.0, 9.0, "chat", 0, "", False, "lost: stream ended without [DONE]"
    ]  # fmt: skip
    assert doc["verdict"]["passed"] is False and doc["verdict"]["lost"] == 1
    json.dumps(doc)  # serialisable as it is
