"""Side-by-side tables of run summaries: the rows, their formats, text and Markdown.

A summary is a dict of numbers (``kvroute bench``'s per target, ``kvroute simulate``'s
per run); a row spec names a key path in it, a format and which way is better.
:func:`table_rows` makes a table of several summaries with each one's ratio to a
baseline, :func:`render_text` and :func:`render_markdown` print it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from router.workloads.stats import ratio


def lookup(summary: dict[str, Any], path: str) -> float | None:
    """The number at a dotted key path of a summary (``ttft_s.p99``); None when it is
    missing, None or NaN."""
    value: Any = summary
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return float(value)


def fmt(value: float | None, kind: str) -> str:
    """``value`` in a row's format: ``pct``, ``ms`` (from seconds), ``s``, ``x``,
    ``int``, else a number with one decimal; ``-`` for None."""
    if value is None:
        return "-"
    if kind == "pct":
        return f"{value:.1%}"
    if kind == "ms":
        return f"{value * 1e3:,.0f} ms" if value >= 0.1 else f"{value * 1e3:.1f} ms"
    if kind == "s":
        return f"{value:.2f} s"
    if kind == "x":
        return f"{value:.2f}"
    if kind == "int":
        return f"{value:,.0f}"
    return f"{value:,.1f}"


#: The columns of a :func:`table_rows` table that label its rows (metric, better): what a
#: wrapped table repeats (``render_text(rows, keep=LABEL_COLUMNS)``).
LABEL_COLUMNS = 2


def table_rows(
    summaries: Sequence[dict[str, Any]],
    baseline: str,
    spec: Sequence[tuple[str, str, str, str]],
) -> list[list[str]]:
    """Header and rows: which way each metric is better, one column per target, then
    each target's ratio to the baseline.

    ``spec`` lists the rows (label, key path, format, which way is better: ``higher``,
    ``lower``, or empty for rows that are no score, which get no ratio). A ratio is the
    target's value over the baseline's, so above 1 is better on a ``higher`` row and
    worse on a ``lower`` one; the ``better`` column says which, on every row."""
    base = next(s for s in summaries if s["name"] == baseline)
    others = [s for s in summaries if s is not base]
    header = [
        "metric",
        "better",
        *(s["name"] for s in summaries),
        *(f"{s['name']}/{baseline}" for s in others),
    ]
    rows = [header]
    for label, path, kind, better in spec:
        if path == "ceiling":
            # One workload, one ceiling: show it once (targets differ only by timing noise).
            cells = [fmt(lookup(summaries[0], path), kind)] + [""] * (len(summaries) - 1)
            rows.append([label, better, *cells, *([""] * len(others))])
            continue
        values = [lookup(s, path) for s in summaries]
        ratios = []
        for s in others:
            r = ratio(lookup(s, path), lookup(base, path))
            ratios.append("-" if r is None or not better else f"{r:.2f}x")
        rows.append([label, better, *(fmt(v, kind) for v in values), *ratios])
    return rows


def ratio_note(baseline: str) -> str:
    """The line under a comparison table that says how to read its ratios."""
    return (
        f"ratios: a target's value over {baseline}'s; above 1 is better on a 'higher' "
        "row, worse on a 'lower' one"
    )


#: The widest a printed table may be (a terminal's width, less a margin): a wider one
#: wraps into several tables of columns (:func:`wrap_columns`).
TABLE_WIDTH = 100


def _widths(rows: list[list[str]]) -> list[int]:
    return [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]


def wrap_columns(
    rows: list[list[str]], width: int = TABLE_WIDTH, keep: int = 1
) -> list[list[list[str]]]:
    """A table (a header, then rows) cut into tables of columns no wider than ``width``
    in :func:`render_text`: each repeats the first ``keep`` columns (the row labels) and
    takes as many of the other columns, in order, as fit (one at least, however wide).
    A table that fits is returned whole."""
    widths = _widths(rows)
    labels = sum(widths[:keep]) + 2 * (keep - 1)
    groups: list[list[int]] = [[]]
    used = labels
    for column in range(keep, len(widths)):
        if groups[-1] and used + 2 + widths[column] > width:
            groups.append([])
            used = labels
        groups[-1].append(column)
        used += 2 + widths[column]
    return [[[row[i] for i in [*range(keep), *group]] for row in rows] for group in groups]


def render_text(rows: list[list[str]], width: int = TABLE_WIDTH, keep: int = 1) -> str:
    """An aligned text table: the first column left, the others right, a rule under the
    header. Wider than ``width``, it wraps into several (:func:`wrap_columns`, each
    repeating the first ``keep`` columns), a blank line apart."""
    return "\n\n".join(_render_text(table) for table in wrap_columns(rows, width, keep))


def _render_text(rows: list[list[str]]) -> str:
    widths = _widths(rows)
    lines = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])]
        cells += [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_markdown(rows: list[list[str]]) -> str:
    """The table as Markdown, the first row its header."""
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(lines)
