"""The statistics runs are judged by, live (``kvroute bench``) or simulated."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def latency_stats(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, p50, p90 and p99 of ``values`` (None each when there are none)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {
        "mean": statistics.fmean(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, or None when either is unknown or ``den`` is 0."""
    if num is None or den is None or den == 0:
        return None
    return num / den
