"""Turn live runs into numbers, the rows of their table, a JSON file and PNG plots.

Hit rates come from the engines' own prefix-cache counters (tokens served from cache
over tokens queried, the difference between the scrapes before and after the run);
the client's view (``usage.prompt_tokens_details.cached_tokens``) is reported next to
it. The ceiling is what one engine with an infinite cache would have served on the
requests actually sent (:func:`router.workloads.ceilings.prefix_ceiling`, counted with
the emulator's tokenizer). The table is drawn by :mod:`router.workloads.tables` from
:data:`ROWS`. Plots need matplotlib, imported only when plotting.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from router.bench.loadgen import Result
from router.bench.runner import EngineSnapshot, TargetRun
from router.workloads.ceilings import prefix_ceiling
from router.workloads.spec import answer_tokens, spec_tokens
from router.workloads.stats import latency_stats, ratio
from router.workloads.tables import fmt

#: Block size assumed when no engine advertises one (vLLM's and the emulator's default).
DEFAULT_BLOCK_SIZE = 16
#: Width of the sliding window of the hit-rate-over-time plot.
HIT_RATE_WINDOW_S = 5.0


def _delta(after: EngineSnapshot, before: EngineSnapshot, field: str) -> float | None:
    if not (after.ok and before.ok):
        return None
    return float(getattr(after, field) - getattr(before, field))


def _engine_latency(run: TargetRun) -> tuple[float | None, float | None]:
    """The engines' own mean TTFT and mean time after it (their end-to-end histogram
    less their TTFT one, arrival at the engine to the last token), over every engine;
    None when an engine could not be read or exports neither (SGLang's names)."""
    sums = {"first_tokens": 0.0, "ttft_sum": 0.0, "finished": 0.0, "e2e_sum": 0.0}
    for before, after in zip(run.before, run.after, strict=True):
        for name in sums:
            delta = _delta(after, before, name)
            if delta is None:
                return None, None
            sums[name] += delta
    ttft = ratio(sums["ttft_sum"], sums["first_tokens"])
    e2e = ratio(sums["e2e_sum"], sums["finished"])
    return ttft, None if ttft is None or e2e is None else e2e - ttft


def block_size_of(run: TargetRun) -> int:
    """The engines' block size as they advertise it, else the default."""
    for snap in [*run.before, *run.after]:
        if snap.block_size:
            return snap.block_size
    return DEFAULT_BLOCK_SIZE


def ceiling(results: Sequence[Result], block_size: int) -> float:
    """Infinite-cache token hit rate of the requests that were answered, in send order."""
    ordered = sorted((r for r in results if r.ok), key=lambda r: r.sent_at)
    return prefix_ceiling(
        ((spec_tokens(r.spec), answer_tokens(r.text)) for r in ordered), block_size
    )


def summarize_run(run: TargetRun) -> dict[str, Any]:
    """Every number of one run (seconds and ratios, not formatted)."""
    ok = [r for r in run.results if r.ok]
    errors = [r for r in run.results if not r.ok]
    examples = list(dict.fromkeys(f"{r.status}: {r.error[:160]}" for r in errors))[:3]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.completion_tokens for r in ok)

    engines = []
    for url, before, after, series in zip(
        run.engine_urls, run.before, run.after, run.samples, strict=True
    ):
        queries, hits = _delta(after, before, "queries"), _delta(after, before, "hits")
        loads = [s.running + s.waiting for s in series if s.ok]
        engines.append(
            {
                "url": url,
                "requests": _delta(after, before, "finished"),
                "queried_tokens": queries,
                "hit_tokens": hits,
                "hit_rate": ratio(hits, queries),
                "prefill_tokens": None if queries is None or hits is None else queries - hits,
                "mean_load": statistics.fmean(loads) if loads else None,
                "peak_load": max(loads) if loads else None,
                "preemptions": _delta(after, before, "preemptions"),
            }
        )
    known = [e for e in engines if e["queried_tokens"] is not None]
    queried = sum(e["queried_tokens"] for e in known) if known else None
    hit = sum(e["hit_tokens"] for e in known) if known else None
    prefill = [e["prefill_tokens"] for e in known]
    served = [e["requests"] for e in known]
    block_size = block_size_of(run)
    engine_ttft, engine_decode = _engine_latency(run)
    return {
        "name": run.name,
        "spec": run.spec,
        "url": run.url,
        "requests": len(run.results),
        "ok": len(ok),
        "errors": len(errors),
        "error_examples": examples,
        "duration_s": run.duration,
        "request_throughput": ratio(len(ok), run.duration),
        "input_token_throughput": ratio(prompt, run.duration),
        "output_token_throughput": ratio(output, run.duration),
        "ttft_s": latency_stats([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": latency_stats([gap for r in ok for gap in r.itl]),
        "e2e_s": latency_stats([r.e2e for r in ok]),
        "decode_s": latency_stats([r.e2e - r.ttft for r in ok if r.ttft is not None]),
        "engine_ttft_mean_s": engine_ttft,
        "engine_decode_mean_s": engine_decode,
        "hit_rate": ratio(hit, queried),
        "hit_rate_client": ratio(sum(r.cached_tokens for r in ok), prompt),
        "ceiling": ceiling(run.results, block_size),
        "block_size": block_size,
        "prefill_imbalance": ratio(max(prefill), statistics.fmean(prefill)) if prefill else None,
        "request_imbalance": ratio(max(served), statistics.fmean(served)) if served else None,
        "preemptions": sum(e["preemptions"] or 0 for e in known) if known else None,
        "engines": engines,
        "timeseries": _timeseries(run),
        "results": [_result_record(r) for r in run.results],
    }


def _timeseries(run: TargetRun) -> dict[str, Any]:
    series = run.samples
    t = [s.t for s in series[0]] if series else []
    return {
        "t": t,
        "engines": [
            {
                "url": url,
                "load": [s.running + s.waiting if s.ok else None for s in samples],
                "kv_usage": [s.kv_usage if s.ok else None for s in samples],
                "queries": [s.queries if s.ok else None for s in samples],
                "hits": [s.hits if s.ok else None for s in samples],
            }
            for url, samples in zip(run.engine_urls, series, strict=True)
        ],
    }


def _result_record(r: Result) -> dict[str, Any]:
    return {
        "sent_at": round(r.sent_at, 4),
        "status": r.status,
        "engine": r.engine,
        "group": r.spec.group,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "completion_tokens": r.completion_tokens,
        "ttft": r.ttft,
        "e2e": r.e2e,
        "error": r.error,
    }


# ------------------------------------------------------------------------------ tables

#: The rows of a live run's table (:func:`router.workloads.tables.table_rows`): (label,
#: key path, format, which way is better); formats: pct, ms, s, x, int, num
ROWS: list[tuple[str, str, str, str]] = [
    ("requests answered", "ok", "int", "higher"),
    ("errors", "errors", "int", "lower"),
    ("prefix-cache hit rate (engines)", "hit_rate", "pct", "higher"),
    ("hit rate (client usage)", "hit_rate_client", "pct", "higher"),
    ("ceiling (infinite cache)", "ceiling", "pct", ""),
    ("TTFT mean", "ttft_s.mean", "ms", "lower"),
    ("TTFT p50", "ttft_s.p50", "ms", "lower"),
    ("TTFT p90", "ttft_s.p90", "ms", "lower"),
    ("TTFT p99", "ttft_s.p99", "ms", "lower"),
    ("inter-token latency p50", "itl_s.p50", "ms", "lower"),
    ("inter-token latency p99", "itl_s.p99", "ms", "lower"),
    ("end-to-end p50", "e2e_s.p50", "s", "lower"),
    ("end-to-end p99", "e2e_s.p99", "s", "lower"),
    ("TTFT mean at the engines", "engine_ttft_mean_s", "ms", "lower"),
    ("after the first token, mean", "decode_s.mean", "ms", "lower"),
    ("after the first token at the engines, mean", "engine_decode_mean_s", "ms", "lower"),
    ("throughput, requests/s", "request_throughput", "num", "higher"),
    ("throughput, output tokens/s", "output_token_throughput", "num", "higher"),
    ("prefill load max/mean", "prefill_imbalance", "x", "lower"),
    ("requests max/mean", "request_imbalance", "x", "lower"),
    ("preemptions", "preemptions", "int", "lower"),
    ("wall time", "duration_s", "s", ""),
]


def engine_lines(summary: dict[str, Any]) -> list[str]:
    """Per-engine detail of one target: requests, hit rate, prefill tokens, load."""
    out = [f"  {summary['name']}: per engine (requests, hit rate, prefill tokens, mean load)"]
    for e in summary["engines"]:
        out.append(
            f"    {e['url']:<26} {fmt(e['requests'], 'int'):>6}  {fmt(e['hit_rate'], 'pct'):>6}"
            f"  {fmt(e['prefill_tokens'], 'int'):>10}  {fmt(e['mean_load'], 'num'):>6}"
        )
    return out


# ------------------------------------------------------------------------------ files


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")


def save_results(path: str | Path, document: dict[str, Any]) -> None:
    """Write a benchmark's results (creating the directory) and say where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {out}")


def windowed_hit_rate(
    t: Sequence[float], hits: Sequence[float], queries: Sequence[float]
) -> list[float | None]:
    """Hit rate since the latest sample at least :data:`HIT_RATE_WINDOW_S` seconds older
    (or the first sample), at each sample."""
    out: list[float | None] = []
    j = 0
    for i in range(len(t)):
        while j + 1 < i and t[i] - t[j + 1] >= HIT_RATE_WINDOW_S:
            j += 1
        dq = queries[i] - queries[j]
        out.append((hits[i] - hits[j]) / dq if dq > 0 else None)
    return out


def plot(summaries: Sequence[dict[str, Any]], outdir: Path, title: str) -> list[Path]:
    """TTFT CDF, per-engine load over time and hit rate over time, as PNG files."""
    import matplotlib

    matplotlib.use("Agg")

    written = [_save(ttft_figure(summaries, title), outdir / "ttft_cdf.png")]
    with_engines = [s for s in summaries if s["timeseries"]["engines"]]
    if with_engines:
        written.append(_save(load_figure(with_engines, title), outdir / "engine_load.png"))
        written.append(_save(hit_rate_figure(summaries, title), outdir / "hit_rate.png"))
    return written


def line_styles(count: int) -> list[dict[str, Any]]:
    """Keyword arguments of ``count`` lines that stay told apart where they coincide (a
    round robin's engines carry the same load): each thinner than the one before and
    dashed its own way, so a line drawn over another leaves it showing."""
    dashes = ("-", "--", ":", "-.")
    return [
        {"linestyle": dashes[i % len(dashes)], "linewidth": max(0.8, 2.6 - 0.45 * i)}
        for i in range(count)
    ]


def _plain_log_labels(axis: Any) -> None:
    """A log axis labelled 20, 300, 1,000 where matplotlib writes 2x10^1: on the ticks
    its own log formatter labels."""
    from matplotlib import ticker

    # Defined here: matplotlib (the bench extra) is imported only to plot.
    class PlainLog(ticker.LogFormatter):
        def __call__(self, x: float, pos: int | None = None) -> str:
            return f"{x:,.6g}" if super().__call__(x, pos) else ""

    axis.set_major_formatter(PlainLog())
    axis.set_minor_formatter(PlainLog())


def ttft_figure(summaries: Sequence[dict[str, Any]], title: str) -> Any:
    """Each target's TTFT CDF on a log time axis."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s, style in zip(summaries, line_styles(len(summaries)), strict=True):
        ttfts = sorted(r["ttft"] for r in s["results"] if r["ttft"] is not None and not r["error"])
        if ttfts:
            ax.plot(
                [v * 1e3 for v in ttfts],
                [(i + 1) / len(ttfts) for i in range(len(ttfts))],
                label=s["name"],
                **style,
            )
    ax.set_xscale("log")
    _plain_log_labels(ax.xaxis)
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"TTFT CDF: {title}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


def load_figure(summaries: Sequence[dict[str, Any]], title: str) -> Any:
    """Each engine's load over time, one panel per target, one legend beside them all."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(summaries),
        1,
        figsize=(7.8, 2.4 * len(summaries)),
        sharex=True,
        squeeze=False,
        layout="constrained",
    )
    for ax, s in zip(axes[:, 0], summaries, strict=True):
        ts = s["timeseries"]
        for i, (engine, style) in enumerate(
            zip(ts["engines"], line_styles(len(ts["engines"])), strict=True)
        ):
            ax.plot(
                ts["t"],
                [v if v is not None else math.nan for v in engine["load"]],
                label=f"engine {i}",
                color=f"C{i % 10}",
                **style,
            )
        ax.set_ylabel("running + waiting")
        ax.set_title(s["name"], fontsize=9)
        ax.grid(True, alpha=0.3)
    most = max(axes[:, 0], key=lambda ax: len(ax.get_lines()))
    fig.legend(*most.get_legend_handles_labels(), loc="outside right upper", fontsize=7)
    axes[-1, 0].set_xlabel("seconds into the run")
    fig.suptitle(f"Per-engine load: {title}", fontsize=9)
    return fig


def hit_rate_figure(summaries: Sequence[dict[str, Any]], title: str) -> Any:
    """Each target's hit rate over a sliding window, under the ceiling."""
    import matplotlib.pyplot as plt

    with_engines = [s for s in summaries if s["timeseries"]["engines"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s, style in zip(with_engines, line_styles(len(with_engines)), strict=True):
        ts = s["timeseries"]
        totals_h = [sum(e["hits"][i] or 0 for e in ts["engines"]) for i in range(len(ts["t"]))]
        totals_q = [sum(e["queries"][i] or 0 for e in ts["engines"]) for i in range(len(ts["t"]))]
        rates = windowed_hit_rate(ts["t"], totals_h, totals_q)
        ax.plot(ts["t"], [math.nan if r is None else r for r in rates], label=s["name"], **style)
    top = summaries[0]["ceiling"]
    ax.axhline(top, linestyle="--", color="grey", label=f"ceiling {top:.0%}")
    ax.set_ylim(0, 1)
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel(f"prefix-cache hit rate (last {HIT_RATE_WINDOW_S:.0f} s)")
    ax.set_title(f"Hit rate over time: {title}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    if fig.get_layout_engine() is None:  # a constrained layout places itself
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
