"""Target specs of kvroute bench: URLs, kvroute policies, external router commands."""

from __future__ import annotations

import pytest

from router.bench.report import ROWS, windowed_hit_rate
from router.bench.targets import Target, TargetError, command_argv, parse_target
from router.workloads.tables import LABEL_COLUMNS, fmt, render_text, table_rows, wrap_columns


def test_targets_are_urls_policies_or_commands() -> None:
    assert parse_target("prod=http://10.0.0.1:8000/") == Target(
        "prod", "url", "http://10.0.0.1:8000"
    )
    assert parse_target("http://127.0.0.1:9000", name="one").name == "one"
    assert parse_target("kv=policy:default") == Target("kv", "policy", "latency")
    assert parse_target("policy:round_robin") == Target("round_robin", "policy", "round_robin")
    cmd = parse_target("sgl=cmd:router --port {port}=x")
    assert cmd == Target("sgl", "cmd", "router --port {port}=x")
    assert cmd.spec == "cmd:router --port {port}=x"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kv=policy:best", "unknown kvroute policy 'best'"),
        ("=policy:kv_cost", "empty target name"),
        ("x=cmd:  ", "empty command"),
        ("x=ftp://host", "cannot read target"),
    ],
)
def test_a_bad_target_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(TargetError, match=message):
        parse_target(text)


def test_command_templates_get_engines_host_and_port() -> None:
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    argv = command_argv(
        "router --worker-urls {engines} --csv={engines_csv} --host {host} --port {port}",
        urls,
        "127.0.0.1",
        9,
    )
    assert argv == [
        "router",
        "--worker-urls",
        *urls,
        "--csv=http://127.0.0.1:1,http://127.0.0.1:2",
        "--host",
        "127.0.0.1",
        "--port",
        "9",
    ]
    with pytest.raises(TargetError, match="bad command template"):
        command_argv("router {nope}", urls, "127.0.0.1", 9)


def test_command_templates_get_kv_event_sources_and_a_spare_port() -> None:
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    lists = {"kv_event_sources": [f"{u}=ipc:///tmp/e{i}" for i, u in enumerate(urls)]}
    argv = command_argv(
        "router --kv-event-source {kv_event_sources} --metrics-port {free_port}",
        urls,
        "127.0.0.1",
        9,
        lists,
    )
    assert argv[:4] == ["router", "--kv-event-source", *lists["kv_event_sources"]]
    assert argv[4] == "--metrics-port" and 0 < int(argv[5]) < 65536
    repeated = command_argv("r {each:--src:kv_event_sources}", urls, "127.0.0.1", 9, lists)
    assert repeated == [
        "r",
        "--src",
        lists["kv_event_sources"][0],
        "--src",
        lists["kv_event_sources"][1],
    ]


def test_the_table_puts_targets_side_by_side_with_ratios_to_the_baseline() -> None:
    base = {"name": "rr", "ok": 10, "hit_rate": 0.2, "ttft_s": {"p50": 0.5}, "ceiling": 0.4}
    kv = {"name": "kv", "ok": 10, "hit_rate": 0.3, "ttft_s": {"p50": 0.25}, "ceiling": 0.4}
    rows = table_rows([base, kv], "rr", ROWS)
    assert rows[0] == ["metric", "better", "rr", "kv", "kv/rr"]
    by_label = {row[0]: row[1:] for row in rows}
    assert by_label["prefix-cache hit rate (engines)"] == ["higher", "20.0%", "30.0%", "1.50x"]
    assert by_label["TTFT p50"] == ["lower", "500 ms", "250 ms", "0.50x"]
    assert by_label["ceiling (infinite cache)"] == ["", "40.0%", "", ""]
    assert by_label["TTFT p99"] == ["lower", "-", "-", "-"]
    assert by_label["wall time"] == ["", "-", "-", "-"]  # no score: no ratio


def test_every_row_with_a_ratio_says_which_way_is_better() -> None:
    summaries = [{"name": n, "ok": 1, "ceiling": 0.5} for n in ("rr", "kv")]
    for row in table_rows(summaries, "rr", ROWS)[1:]:
        assert row[1] in ("higher", "lower") or row[-1] in ("", "-"), row


def eight_policies() -> list[list[str]]:
    names = ["kv_cost", "latency", "round_robin", "random", "least_loaded", "power_of_two",
             "session", "cache_aware_sglang"]  # fmt: skip
    summaries = [{"name": n, "ok": 100, "hit_rate": 0.25, "ttft_s": {"p50": 0.2}} for n in names]
    return table_rows(summaries, "kv_cost", ROWS)


def test_a_wide_table_wraps_into_tables_of_columns_within_the_width() -> None:
    rows = eight_policies()
    tables = wrap_columns(rows, width=100, keep=LABEL_COLUMNS)
    assert len(tables) > 1
    for table in tables:
        assert [row[:LABEL_COLUMNS] for row in table] == [row[:LABEL_COLUMNS] for row in rows]
    # Every other column once, in order.
    assert [c for t in tables for c in t[0][LABEL_COLUMNS:]] == rows[0][LABEL_COLUMNS:]
    text = render_text(rows, keep=LABEL_COLUMNS)
    assert max(len(line) for line in text.splitlines()) <= 100
    assert text.count("\nmetric ") == len(tables) - 1  # a header per table


def test_a_table_that_fits_stays_whole() -> None:
    rows = [["metric", "a", "b"], ["hit rate", "1.0%", "2.0%"]]
    assert wrap_columns(rows) == [rows]
    assert render_text(rows).splitlines() == [
        "metric       a     b",
        "--------  ----  ----",
        "hit rate  1.0%  2.0%",
    ]


def test_a_column_wider_than_the_width_gets_a_table_of_its_own() -> None:
    rows = [["label", "x" * 120, "y"], ["row", "1", "2"]]
    assert [t[0] for t in wrap_columns(rows, width=100)] == [["label", "x" * 120], ["label", "y"]]


def test_number_formats() -> None:
    assert fmt(None, "pct") == "-"
    assert fmt(0.0123, "ms") == "12.3 ms"
    assert fmt(1.5, "ms") == "1,500 ms"
    assert fmt(2.0, "x") == "2.00"


def test_hit_rate_over_time_uses_a_sliding_window() -> None:
    t = [0.0, 1.0, 2.0, 10.0]
    queries = [0.0, 100.0, 200.0, 300.0]
    hits = [0.0, 0.0, 100.0, 200.0]
    assert windowed_hit_rate(t, hits, queries) == [None, 0.0, 0.5, 1.0]
