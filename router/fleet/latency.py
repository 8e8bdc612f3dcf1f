"""The online latency model: per engine, how long a prefill and a decode step take.

Two straight lines per engine, each fitted online from what the router observes of its
own requests:

* **time to first token** = ``ttft_overhead_s`` + ``prefill_s_per_token`` x (prefill
  tokens queued ahead of the request when it was sent + its own uncached prompt
  tokens). Observed when a streamed request's first token arrives
  (:meth:`LoadTracker.prefilled <router.fleet.load.LoadTracker.prefilled>`).
* **time per output token** = ``tpot_base_s`` + ``tpot_s_per_seq`` x sequences
  decoding on the engine. Observed when a request ends, from its first-token time, end
  time and output tokens, against the sequences that decoded there meanwhile.

Each line is a weighted least-squares fit whose observations decay with age
(``half_life_s``): an engine that slows down is noticed within a few half-lives. The
configured priors count as ``prior_weight`` observations that never decay, so a new or
quiet engine is predicted from them and a few noisy samples cannot fling a coefficient
anywhere. Slopes and intercepts never go below zero.

The model belongs to the load tracker, not to the policy, so a reload of the
``policy`` section (new weights, another policy) keeps what was learnt; only the priors
change. The ``latency`` policy (:mod:`router.policy.latency`) reads the coefficients
from :attr:`EngineLoad.latency <router.fleet.load.EngineLoad.latency>`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.metric_catalogue import (
    ENGINE_LATENCY_OBSERVATIONS,
    ENGINE_PREFILL_SECONDS_PER_TOKEN,
    ENGINE_PREFILL_UTILIZATION,
    ENGINE_TPOT_BASE_SECONDS,
    ENGINE_TPOT_SECONDS_PER_SEQUENCE,
    ENGINE_TTFT_OVERHEAD_SECONDS,
)
from router.types import EngineKey

if TYPE_CHECKING:
    from router.metric_catalogue import StateFamily


@dataclass(frozen=True, slots=True)
class LatencyPriors:
    """What the model assumes before it has observed an engine (``policy.latency``)."""

    prefill_s_per_token: float = 50e-6
    ttft_overhead_s: float = 0.02
    tpot_base_s: float = 0.01
    tpot_s_per_seq: float = 0.0002
    prior_weight: float = 8.0
    """How many observations the priors are worth (they never decay)."""
    half_life_s: float = 60.0
    """Seconds after which an observation weighs half as much."""


class LineFit:
    """``y = intercept + slope * x`` by weighted least squares: decaying observations
    plus a prior that counts as ``prior_weight`` observations, each at the prior's
    line at ``prior_x`` (the prior pins the slope only as much as the data's spread
    leaves it free)."""

    __slots__ = ("_at", "_n", "_sx", "_sxx", "_sxy", "_sy", "intercept", "observations", "slope")

    def __init__(self) -> None:
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._at: float | None = None
        self.observations = 0
        self.slope = 0.0
        self.intercept = 0.0

    def decay(self, now: float, half_life_s: float) -> None:
        """Age the observations to ``now``."""
        if self._at is not None and now > self._at:
            keep = 0.5 ** ((now - self._at) / half_life_s)
            self._n *= keep
            self._sx *= keep
            self._sy *= keep
            self._sxx *= keep
            self._sxy *= keep
        if self._at is None or now > self._at:
            self._at = now

    def add(self, x: float, y: float) -> None:
        self._n += 1.0
        self._sx += x
        self._sy += y
        self._sxx += x * x
        self._sxy += x * y
        self.observations += 1

    @property
    def weight(self) -> float:
        """The observations' decayed weight."""
        return self._n

    def solve(self, slope: float, intercept: float, prior_weight: float, prior_x: float) -> None:
        """Fit the line, pulled toward the prior ``(slope, intercept)``.

        The prior is ``prior_weight`` observations split between x = 0 and x =
        ``prior_x`` on the prior's line: it anchors both the intercept and the slope, and
        yields to data that spans x."""
        half = prior_weight / 2
        n = self._n + prior_weight
        sx = self._sx + half * prior_x
        sy = self._sy + half * intercept + half * (intercept + slope * prior_x)
        sxx = self._sxx + half * prior_x * prior_x
        sxy = self._sxy + half * prior_x * (intercept + slope * prior_x)
        det = n * sxx - sx * sx
        if n <= 0 or det <= 1e-12 * max(n * sxx, 1e-300):
            self.slope, self.intercept = slope, intercept
            return
        b = (n * sxy - sx * sy) / det
        a = (sy - b * sx) / n
        if b < 0:  # more work never takes less time: the best line through the mean
            b = 0.0
            a = sy / n
        if a < 0:  # nor does no work take negative time: the best line through 0
            a = 0.0
            b = sxy / sxx if sxx > 0 else slope
        if not (math.isfinite(a) and math.isfinite(b)):
            a, b = intercept, slope
        self.slope, self.intercept = b, a


class EngineLatency:
    """One engine's two fitted lines (read by the ``latency`` policy)."""

    __slots__ = (
        "_priors",
        "prefill_s_per_token",
        "tpot",
        "tpot_base_s",
        "tpot_s_per_seq",
        "ttft",
        "ttft_overhead_s",
    )

    #: Where the TTFT prior's slope is anchored: a typical prompt plus its queue.
    PRIOR_TOKENS = 4096.0
    #: Where the TPOT prior's slope is anchored: a typical decode batch.
    PRIOR_SEQS = 32.0

    def __init__(self, priors: LatencyPriors) -> None:
        self.ttft = LineFit()
        self.tpot = LineFit()
        self._priors = priors
        self.prefill_s_per_token = priors.prefill_s_per_token
        self.ttft_overhead_s = priors.ttft_overhead_s
        self.tpot_base_s = priors.tpot_base_s
        self.tpot_s_per_seq = priors.tpot_s_per_seq

    def reprior(self, priors: LatencyPriors) -> None:
        """New priors (a reload): refit with what was observed."""
        self._priors = priors
        self._fit_ttft()
        self._fit_tpot()

    def observe_ttft(self, now: float, tokens: float, seconds: float) -> None:
        self.ttft.decay(now, self._priors.half_life_s)
        self.ttft.add(tokens, seconds)
        self._fit_ttft()

    def observe_tpot(self, now: float, seqs: float, seconds: float) -> None:
        self.tpot.decay(now, self._priors.half_life_s)
        self.tpot.add(seqs, seconds)
        self._fit_tpot()

    def _fit_ttft(self) -> None:
        p = self._priors
        self.ttft.solve(p.prefill_s_per_token, p.ttft_overhead_s, p.prior_weight, self.PRIOR_TOKENS)
        self.prefill_s_per_token = self.ttft.slope
        self.ttft_overhead_s = self.ttft.intercept

    def _fit_tpot(self) -> None:
        p = self._priors
        self.tpot.solve(p.tpot_s_per_seq, p.tpot_base_s, p.prior_weight, self.PRIOR_SEQS)
        self.tpot_s_per_seq = self.tpot.slope
        self.tpot_base_s = self.tpot.intercept

    def ttft_s(self, tokens: float) -> float:
        """Predicted seconds to the first token with ``tokens`` of prefill to go."""
        return self.ttft_overhead_s + self.prefill_s_per_token * tokens

    def tpot_s(self, seqs: float) -> float:
        """Predicted seconds per output token with ``seqs`` sequences decoding."""
        return self.tpot_base_s + self.tpot_s_per_seq * seqs

    def as_dict(self) -> dict[str, float]:
        """For ``kvroute status`` and the admin API."""
        return {
            "prefill_us_per_token": round(self.prefill_s_per_token * 1e6, 3),
            "ttft_overhead_ms": round(self.ttft_overhead_s * 1e3, 3),
            "tpot_base_ms": round(self.tpot_base_s * 1e3, 3),
            "tpot_us_per_seq": round(self.tpot_s_per_seq * 1e6, 3),
            "ttft_observations": self.ttft.observations,
            "tpot_observations": self.tpot.observations,
        }


class LatencyModel:
    """Every engine's :class:`EngineLatency`, made on first use from the priors."""

    def __init__(self, priors: LatencyPriors | None = None) -> None:
        self.priors = priors or LatencyPriors()
        self.engines: dict[EngineKey, EngineLatency] = {}

    def of(self, engine: EngineKey) -> EngineLatency:
        latency = self.engines.get(engine)
        if latency is None:
            latency = self.engines[engine] = EngineLatency(self.priors)
        return latency

    def reconfigure(self, priors: LatencyPriors) -> None:
        """New priors; every engine keeps its observations."""
        if priors == self.priors:
            return
        self.priors = priors
        for latency in self.engines.values():
            latency.reprior(priors)

    def forget(self, engine: EngineKey) -> None:
        self.engines.pop(engine, None)

    def metric_families(
        self, engines: Sequence[EngineKey], offered: Callable[[EngineKey], float]
    ) -> Iterator[StateFamily]:
        """The fitted lines of each of ``engines`` that has some, its prefill utilization
        (``offered``: its uncached prompt tokens per second lately) and the observations
        behind them."""
        prefill = ENGINE_PREFILL_SECONDS_PER_TOKEN.labelled()
        overhead = ENGINE_TTFT_OVERHEAD_SECONDS.labelled()
        tpot_base = ENGINE_TPOT_BASE_SECONDS.labelled()
        tpot_per_seq = ENGINE_TPOT_SECONDS_PER_SEQUENCE.labelled()
        utilization = ENGINE_PREFILL_UTILIZATION.labelled()
        observed = ENGINE_LATENCY_OBSERVATIONS.labelled()
        for key in engines:
            fit = self.engines.get(key)
            if fit is None:
                continue
            label = [key.label]
            prefill.add_metric(label, fit.prefill_s_per_token)
            overhead.add_metric(label, fit.ttft_overhead_s)
            tpot_base.add_metric(label, fit.tpot_base_s)
            tpot_per_seq.add_metric(label, fit.tpot_s_per_seq)
            utilization.add_metric(label, fit.prefill_s_per_token * offered(key))
            observed.add_metric([key.label, "ttft"], fit.ttft.observations)
            observed.add_metric([key.label, "tpot"], fit.tpot.observations)
        yield prefill
        yield overhead
        yield tpot_base
        yield tpot_per_seq
        yield utilization
        yield observed


__all__ = ["EngineLatency", "LatencyModel", "LatencyPriors", "LineFit"]
