"""``kvroute bench --tenants``: tenant specs, their arrivals and their result rows."""

from __future__ import annotations

import pytest

from router.bench.loadgen import Result
from router.bench.tenants import (
    TenantSpec,
    parse_tenant,
    render_rows,
    summarize_tenant,
    tenant_specs,
)
from router.cli import _parser
from router.workloads.spec import RequestSpec


def test_a_tenant_spec_reads_every_setting() -> None:
    spec = parse_tenant("batch:rate=2.5,priority=-1,key=k-1,prompt=64,output=8")
    assert spec == TenantSpec("batch", 2.5, -1, "k-1", 64, 8)
    assert spec.headers() == {
        "x-kvroute-tenant": "batch",
        "x-kvroute-priority": "-1",
        "Authorization": "Bearer k-1",
    }
    assert parse_tenant("quiet:rate=1").headers() == {"x-kvroute-tenant": "quiet"}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("quiet", "expected NAME:rate=R"),
        ("quiet:priority=1", "rate=R"),
        ("quiet:rate=1,colour=red", "unknown or empty setting 'colour=red'"),
        ("quiet:rate=-1", "must be positive"),
        ("quiet:rate=fast", "could not convert"),
    ],
)
def test_a_bad_tenant_spec_is_refused_naming_what_is_wrong(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_tenant(text)


def test_arrivals_follow_the_rate_and_repeat_with_the_seed() -> None:
    tenant = TenantSpec("noisy", 20.0, prompt_tokens=5, output_tokens=3)
    specs = tenant_specs(tenant, 50.0, seed=1)
    assert 900 <= len(specs) <= 1100  # 20/s for 50 s
    assert all(0 <= s.at < 50 for s in specs if s.at is not None)
    assert [s.at for s in specs] == sorted(s.at for s in specs if s.at is not None)
    assert specs == tenant_specs(tenant, 50.0, seed=1)
    assert len({s.prompt for s in specs}) == len(specs) and specs[0].max_tokens == 3


def test_a_tenants_row_counts_refusals_apart_from_failures() -> None:
    tenant = TenantSpec("t", 1.0)
    spec = RequestSpec(prompt="x")
    results = [
        Result(spec, status=200, ttft=0.1, completion_tokens=4),
        Result(spec, status=200, ttft=0.3, completion_tokens=4),
        Result(spec, status=429),
        Result(spec, status=502),
    ]
    row = summarize_tenant(tenant, results, duration=2.0)
    assert (row["sent"], row["ok"], row["refused"], row["failed"]) == (4, 2, 1, 1)
    assert row["ttft_p50_s"] == pytest.approx(0.2) and row["throughput_rps"] == 1.0
    assert row["output_tok_s"] == 4.0
    empty = summarize_tenant(tenant, [Result(spec, status=429)], duration=1.0)
    assert empty["ttft_p99_s"] is None
    assert "t " in render_rows([row, empty])


def test_bench_takes_tenants_instead_of_a_workload() -> None:
    args = _parser("bench").parse_args(
        ["bench", "--target", "http://127.0.0.1:1", "--tenants", "a:rate=1", "b:rate=2"]
    )
    assert args.tenants == ["a:rate=1", "b:rate=2"]
