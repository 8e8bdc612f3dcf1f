"""kvroute bench's plots (router/bench/report.py), drawn with matplotlib's Agg backend and
read back from the figures."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import matplotlib
import pytest

from router.bench.report import load_figure, plot, ttft_figure

matplotlib.use("Agg")


@pytest.fixture(autouse=True)
def close_figures() -> Iterator[None]:
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def summary(name: str, ttfts_s: list[float], loads: list[list[float]]) -> dict[str, Any]:
    """A target's summary with these TTFTs and one load series per engine."""
    steps = len(loads[0]) if loads else 0
    return {
        "name": name,
        "ceiling": 0.5,
        "results": [{"ttft": t, "error": None} for t in ttfts_s],
        "timeseries": {
            "t": [float(i) for i in range(steps)],
            "engines": [
                {"load": load, "hits": [10.0 * i for i in range(steps)], "queries": [40.0] * steps}
                for load in loads
            ],
        },
    }


#: Four engines a round robin keeps at the same load.
EVEN = [[0.0, 2.0, 3.0, 3.0, 1.0]] * 4


def tick_labels(axis: Any) -> list[str]:
    texts = axis.get_ticklabels(minor=False) + axis.get_ticklabels(minor=True)
    return [t.get_text() for t in texts if t.get_text()]


def test_the_ttft_axis_is_labelled_in_plain_milliseconds() -> None:
    fig = ttft_figure([summary("kv_cost", [0.015, 0.02, 0.03, 0.04], EVEN)], "t")
    fig.canvas.draw()
    labels = tick_labels(fig.axes[0].xaxis)
    assert "20" in labels and "30" in labels  # not 2x10^1 in mathtext
    assert all(re.fullmatch(r"[0-9][0-9,.]*", label) for label in labels), labels


def test_the_engine_load_legend_sits_beside_the_panels_not_on_them() -> None:
    fig = load_figure([summary("round_robin", [0.1], EVEN), summary("kv_cost", [0.1], EVEN)], "t")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [f"engine {i}" for i in range(4)]
    box = legend.get_window_extent(renderer)
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent(renderer)), ax.get_title()


def test_engines_at_the_same_load_stay_told_apart() -> None:
    fig = load_figure([summary("round_robin", [0.1], EVEN)], "t")
    lines = fig.axes[0].get_lines()
    assert len({(line.get_color(), line.get_linestyle()) for line in lines}) == 4
    # Each drawn thinner than the one under it: every line keeps showing.
    widths = [line.get_linewidth() for line in lines]
    assert widths == sorted(widths, reverse=True) and len(set(widths)) == 4


def test_plot_writes_the_three_pngs(tmp_path: Path) -> None:
    written = plot([summary("kv_cost", [0.02, 0.03], EVEN)], tmp_path, "t")
    assert [p.name for p in written] == ["ttft_cdf.png", "engine_load.png", "hit_rate.png"]
    for path in written:
        assert path.read_bytes().startswith(b"\x89PNG")
