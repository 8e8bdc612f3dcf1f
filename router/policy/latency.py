"""The ``latency`` policy (the default): the engine where the request costs everyone least.

Per candidate, in seconds, from the engine's fitted latency lines
(:mod:`router.fleet.latency`: ``a`` seconds per prefill token, ``b`` seconds of
first-token overhead, the TPOT line ``tpot_base + tpot_per_seq`` per sequence decoding)
or the configured priors while it has not been timed (lower total wins)::

    wait     = a * prefill tokens queued there          (or the backlog clock, queue_model)
    queue    = queue_weight * wait                       the queue ahead of it
    prefill  = (1 + busy) * a * uncached prompt tokens   its own prefill, and the requests
               busy = u / (1 - u), at most prefill_weight - 1, u = a * prefill tokens
               offered to the engine per second lately   arriving behind it meanwhile
    harm     = itl_weight * a * uncached * requests there (harm_counts): those queued
               share its steps, those decoding have theirs lengthened by its chunks
    decode   = slowdown_weight * expected output * tpot_per_seq * sequences decoding there
               (the seconds its decoding adds to theirs; expected output: max_tokens, or
               the engine's recent answers' mean length when that is shorter)
    transfer = the KV transfer's seconds (a split's prefill, topology known)
    reported = (kv_cost's engine-reported terms, in blocks) * a * block_size
    ttft     = b + wait + a * uncached + transfer seconds          (the prediction)
    total    = b + queue + prefill + transfer + decode + reported + harm - session bonus

Every term is time that someone spends waiting because of this placement, so the sum
is the placement's cost to everyone, not only to the request (docs/architecture.md,
"The default policy", says why each term exists and what it does on the workload matrix
of ``kvroute simulate --matrix``):

* A shared prefix held by a busy engine is worth **copying** onto an idle one: there the
  recompute costs only the request's own wait (``busy`` 0), while on the holder every
  request in flight waits for the request's chunks (``harm``) and the holder's load
  makes each second of its prefill cost up to ``prefill_weight`` seconds. Conversations
  sharing a system prompt spread over the engines once their holders are busy, and stay
  (a follow-up turn's cache makes its own engine by far the cheapest).
* A **long prompt** goes where few requests are in flight: its chunks delay each of
  them (``harm``).
* An engine's **own speed** prices its queue: a slower engine's seconds are its own.

**Idle engines.** ``idle_prefill_weight`` (unset: measured, as on any engine) prices the
request's prefill on an engine with nothing in flight from this router or its peers.

**SLOs.** A request with ``slo_ttft_s`` / ``slo_tpot_s`` (headers ``x-slo-ttft-ms``,
``x-slo-tpot-ms``, or the model's defaults) goes to the lowest-cost engine predicted to
meet both; when none is, to the one with the least predicted violation (relative, summed
over both), reason ``slo_unmet``, counted in :attr:`LatencyPolicy.slo_unmet`.

**Session affinity.** A request with a session key (``x-session-id``, configurable, or
the body's ``user``) takes ``session_bonus_ms`` off the cost of the engine that served
its session last, shrinking linearly with that engine's predicted queue wait to nothing
at ``session_max_wait_ms``: it tips near-ties toward the engine holding the
conversation and never pulls it onto a saturated one (engines at the in-flight limit
are no candidates at all).

Costs within ``tie_tolerance`` (2%) of the lowest are ties: the model cannot tell them
apart, and the engine holding more of the prompt wins them (the placement that costs the
fleet the least compute: n samples of one prompt arriving at once stay on the engine
computing it rather than each recomputing it on an idle one), then the session's engine,
then ``kv_cost``'s order
(fewer requests in flight, least recently routed, a hash of the request id);
``temperature`` > 0 samples as ``kv_cost`` does. Without an SLO and at
temperature 0 the compiled helper scores every candidate (``router/native/latency.c``,
the same float operations in the same order as :meth:`LatencyPolicy.score`).
"""

from __future__ import annotations

import math
import statistics
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from router.fleet.latency import LatencyPriors
from router.fleet.load import OFFERED_HALF_LIFE_S, LoadView
from router.hashing import cacheable_blocks, native_helper
from router.index.base import Match
from router.policy.base import Decision, LazyScores, RouteRequest, Score, tiebreak
from router.policy.kv_cost import (
    KVCostPolicy,
    cached_tokens,
    report_cutoff,
    reported_load,
    tier_discounts,
)
from router.policy.registry import PolicyConfig
from router.sessions import SessionMap, session_key
from router.types import EngineKey


def priors_of(config: PolicyConfig) -> LatencyPriors:
    """The latency model's priors from the ``policy.latency`` section."""
    cfg = config.latency
    return LatencyPriors(
        prefill_s_per_token=cfg.prefill_us_per_token * 1e-6,
        ttft_overhead_s=cfg.ttft_overhead_ms * 1e-3,
        tpot_base_s=cfg.tpot_base_ms * 1e-3,
        tpot_s_per_seq=cfg.tpot_us_per_seq * 1e-6,
        prior_weight=cfg.prior_weight,
        half_life_s=cfg.half_life_s,
    )


class LatencyPolicy(KVCostPolicy):
    """Predicted time to first token, decode harm and session affinity, in seconds."""

    name = "latency"

    def __init__(self, config: PolicyConfig, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config, clock)
        lat = config.latency
        self.sessions = SessionMap(lat.session_ttl_s, lat.max_sessions)
        self.slo_checked = 0
        """Decisions made with an SLO."""
        self.slo_unmet = 0
        """Decisions with an SLO no candidate was predicted to meet."""

    def score(
        self,
        request: RouteRequest,
        candidates: Sequence[EngineKey],
        matches: Mapping[EngineKey, Match],
        loads: LoadView,
    ) -> list[Score]:
        cfg = self.config
        lat = cfg.latency
        bs = request.block_size
        isl = request.prompt_tokens
        out = max(request.max_tokens, 0)
        cap = cacheable_blocks(isl, bs) * bs
        offload_discount, disk_extra = tier_discounts(cfg)
        ww, wr, wk = cfg.waiting_weight, cfg.running_weight, cfg.kv_usage_weight
        now = self._clock()
        fresh_after = report_cutoff(cfg, now)
        transfers = request.transfer_tokens  # in prompt tokens' worth of prefill
        per_moved = request.transfer_s_per_token
        pinned = (
            self.sessions.get(session_key(request.session), now)
            if request.session and lat.session_bonus_ms > 0
            else None
        )
        bonus_max = lat.session_bonus_ms * 1e-3
        wait_cap = lat.session_max_wait_ms * 1e-3
        speeds = self._speeds(candidates, loads)
        backlog = lat.queue_model == "backlog"
        by_decoding = lat.harm_counts == "decoding"
        busiest = max(cfg.prefill_weight - 1.0, 0.0)
        idle = lat.idle_prefill_weight
        scores: list[Score] = []
        for engine, (a, b, tpot_base, tpot_seq) in zip(candidates, speeds, strict=True):
            match = matches.get(engine)
            blocks = cached = 0
            if match is not None:
                blocks = match.blocks
                cached = cached_tokens(match, bs, cap, offload_discount, disk_extra)
            uncached = isl - cached
            moved = transfers.get(engine, 0.0) if transfers else 0.0
            load = loads.get(engine)
            queued = decoding = requests = 0
            reported = busy = 0.0
            expected = out  # no answer counted there: max_tokens
            if load is not None:
                queued, decoding, requests = load.prefill_tokens, load.decoding, load.requests
                expected = min(out, load.output_tokens)
                reported = reported_load(load, fresh_after, ww, wr, wk) * a * bs
                busy = _busy(a * load.offered_tokens_per_s(now), busiest)
            if backlog and load is not None and load.latency is not None:
                # The router's own queue as the backlog clock says (work in progress
                # counts what is left of it), the peers' at the fitted speed.
                wait = max(load.backlog_until - now, 0.0) + a * load.peer_prefill_tokens
            else:
                wait = a * queued
            queue = cfg.queue_weight * wait
            if idle is not None and not requests:
                prefill = idle * a * uncached
            else:
                prefill = (1.0 + busy) * a * uncached
            # The request waits for its KV to move; the link is no engine's compute.
            transfer = moved * per_moved if per_moved is not None else a * moved
            # Everyone in flight there waits for its chunks: the queued share its steps,
            # the decoding have theirs lengthened.
            harm = lat.itl_weight * a * uncached * (decoding if by_decoding else requests)
            # Its tokens each lengthen the steps of those decoding there: as many as it is
            # expected to generate (its max_tokens, or fewer as the engine's answers go).
            decode = lat.slowdown_weight * expected * tpot_seq * decoding
            ttft = b + wait + a * uncached + transfer
            bonus = 0.0
            if pinned == engine and wait_cap > 0:
                bonus = max(0.0, bonus_max * (1.0 - wait / wait_cap))
            total = b + queue + prefill + transfer + decode + reported + harm - bonus
            scores.append(
                Score(
                    engine,
                    blocks,
                    cached,
                    queue,
                    prefill,
                    decode,
                    reported,
                    total,
                    transfer,
                    ttft=ttft,
                    harm=harm,
                    tpot=tpot_base + tpot_seq * (decoding + 1),
                    bonus=bonus,
                )
            )
        return scores

    def _speeds(
        self, candidates: Sequence[EngineKey], loads: LoadView
    ) -> list[tuple[float, float, float, float]]:
        """Each candidate's (prefill s/token, TTFT overhead s, TPOT base s, TPOT s/seq),
        in candidate order.

        A fitted coefficient within a factor ``1 + speed_tolerance`` of the
        candidates' lower median is taken as that median: fits of alike engines differ
        by their noise, and ranking on that noise would scatter prefixes the cache
        should keep together. An engine really slower (or faster) keeps its own. The
        first-token overhead is always the median: the fit's intercept is its noisiest
        term (a slow engine's shows in its slope, where the fit puts it), and a few
        milliseconds of it would otherwise decide between alike engines."""
        prior = self._prior()  # for engines never timed (no model: tests)
        rows: list[tuple[float, float, float, float]] = []
        for engine in candidates:
            load = loads.get(engine)
            fit = load.latency if load is not None else None
            if fit is None:
                rows.append(prior)
                continue
            rows.append(
                (fit.prefill_s_per_token, fit.ttft_overhead_s, fit.tpot_base_s, fit.tpot_s_per_seq)
            )
        if len(rows) < 2:
            return rows
        # The lower median: with two candidates (or two groups) the faster one's own
        # value, so a slower one stands out instead of both being averaged.
        medians = [statistics.median_low(col) for col in zip(*rows, strict=True)]
        tol = self.config.latency.speed_tolerance
        low, high = 1.0 / (1.0 + tol), 1.0 + tol
        overhead = medians[1]
        return [
            (
                _near(row[0], medians[0], low, high),
                overhead,
                _near(row[2], medians[2], low, high),
                _near(row[3], medians[3], low, high),
            )
            for row in rows
        ]

    def _prior(self) -> tuple[float, float, float, float]:
        """The priors as a speeds row."""
        prior = priors_of(self.config)
        return (
            prior.prefill_s_per_token,
            prior.ttft_overhead_s,
            prior.tpot_base_s,
            prior.tpot_s_per_seq,
        )

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[EngineKey],
        matches: Mapping[EngineKey, Match],
        loads: LoadView,
    ) -> Decision:
        if (
            _SCAN is not None
            and self.config.temperature <= 0
            and request.slo_ttft_s is None
            and request.slo_tpot_s is None
            and type(self).score is LatencyPolicy.score
            and isinstance(matches, dict)
            and isinstance(loads, dict)
            and (request.transfer_tokens is None or isinstance(request.transfer_tokens, dict))
        ):
            return self._choose_scanned(request, candidates, matches, loads)
        scores = self.score(request, candidates, matches, loads)
        pool = scores
        unmet = False
        slo_ttft, slo_tpot = request.slo_ttft_s, request.slo_tpot_s
        if slo_ttft is not None or slo_tpot is not None:
            self.slo_checked += 1
            misses = [_violation(s, slo_ttft, slo_tpot) for s in scores]
            least = min(misses)
            unmet = least > 0.0
            if unmet:
                self.slo_unmet += 1
            # Those meeting both, else those missing least.
            pool = [s for s, miss in zip(scores, misses, strict=True) if miss - least <= 1e-9]
        if not pool:  # no comparable prediction (finite SLOs always give one): all
            pool = scores
        if self.config.temperature > 0 and len(pool) > 1:
            chosen = self._sample(request, pool)
        else:
            best = min(s.total for s in pool)
            tolerance = max(_TIE, self.config.latency.tie_tolerance * abs(best))
            tied = [s for s in pool if s.total - best <= tolerance]
            chosen = (
                tied[0]
                if len(tied) == 1
                else min(tied, key=lambda s: self._tie_rank(request, s, loads))
            )
        decision = self._decision(chosen, max(s.matched_blocks for s in scores), scores)
        if unmet:
            decision.reason = "slo_unmet"
        elif chosen.bonus and min(s.total + s.bonus for s in pool) < chosen.total + chosen.bonus:
            decision.reason = "session"  # the bonus decided it
        self._pin(request, chosen.engine)
        return decision

    def _scan_params(self, request: RouteRequest) -> tuple[Any, ...]:
        """:meth:`score`'s per-request constants, for the compiled scan."""
        cfg = self.config
        lat = cfg.latency
        bs = request.block_size
        isl = request.prompt_tokens
        now = self._clock()
        return (
            bs,
            isl,
            cacheable_blocks(isl, bs) * bs,
            *tier_discounts(cfg),
            cfg.waiting_weight,
            cfg.running_weight,
            cfg.kv_usage_weight,
            report_cutoff(cfg, now),
            now,
            cfg.queue_weight,
            lat.tie_tolerance,
            max(cfg.prefill_weight - 1.0, 0.0),
            lat.idle_prefill_weight,
            lat.itl_weight,
            lat.harm_counts == "decoding",
            lat.slowdown_weight,
            float(max(request.max_tokens, 0)),
            lat.queue_model == "backlog",
            request.transfer_s_per_token,
            lat.session_bonus_ms * 1e-3,
            lat.session_max_wait_ms * 1e-3,
            lat.speed_tolerance,
            OFFERED_HALF_LIFE_S,
            _LN2,
            _TIE,
            self._prior(),
        )

    def _choose_scanned(
        self,
        request: RouteRequest,
        candidates: Sequence[EngineKey],
        matches: dict[EngineKey, Match],
        loads: dict[EngineKey, Any],
    ) -> Decision:
        """:meth:`choose` without an SLO at temperature 0, from the compiled scan: the same
        terms, the same choice; ``Score`` objects only for tied candidates and the chosen
        one (the rest when a caller reads ``Decision.scores``)."""
        candidates = tuple(candidates)
        lat = self.config.latency
        pinned = (
            self.sessions.get(session_key(request.session), self._clock())
            if request.session and lat.session_bonus_ms > 0
            else None
        )
        tied, deepest, unbonused, columns = _SCAN(
            candidates, matches, loads, request.transfer_tokens, pinned, self._scan_params(request)
        )
        scores = LazyScores(_scores_from(candidates, columns), len(candidates))
        if len(tied) == 1:
            chosen = _score_at(candidates, columns, tied[0])
        else:
            chosen = min(
                (_score_at(candidates, columns, k) for k in tied),
                key=lambda s: self._tie_rank(request, s, loads),
            )
        decision = self._decision(chosen, deepest, scores)
        if chosen.bonus and unbonused < chosen.total + chosen.bonus:
            decision.reason = "session"  # the bonus decided it
        self._pin(request, chosen.engine)
        return decision

    @staticmethod
    def _tie_rank(request: RouteRequest, score: Score, loads: LoadView) -> tuple[float, ...]:
        """Costs within ``tie_tolerance`` of each other: more of the prompt cached there
        (the least compute for the fleet), then the session's engine, then kv_cost's order
        (fewer requests in flight, the engine routed to least recently, a hash of the
        request id)."""
        load = loads.get(score.engine)
        if load is None:
            return (
                -score.cached_tokens,
                -score.bonus,
                0,
                0,
                tiebreak(request.request_id, score.engine),
            )
        return (
            -score.cached_tokens,
            -score.bonus,
            load.requests,
            load.routed,
            tiebreak(request.request_id, score.engine),
        )

    def _pin(self, request: RouteRequest, engine: EngineKey) -> None:
        """The session's next turn should find ``engine``."""
        lat = self.config.latency
        if request.session and lat.session_bonus_ms > 0:
            sessions = self.sessions
            sessions.ttl_s, sessions.max_sessions = lat.session_ttl_s, lat.max_sessions  # reloads
            sessions.note(session_key(request.session), engine, self._clock())

    def forget(self, engine: EngineKey) -> None:
        self.sessions.forget(engine)

    def moved(self, request: RouteRequest, engine: EngineKey) -> None:
        self._pin(request, engine)  # the engine that served this turn has its context


_SCAN: Any = getattr(native_helper(), "latency_scan", None)
"""The compiled twin of :meth:`LatencyPolicy.score`'s loop (router/native/latency.c)."""
_COLUMNS = 12
_TIE = 1e-12
"""Totals this close to the lowest are a tie (seconds)."""
_LN2 = math.log(2.0)


def _score_of(engine: EngineKey, col: array[float], k: int) -> Score:
    """The ``Score`` of the scan's row starting at ``col[k]``."""
    return Score(
        engine,
        int(col[k]),
        int(col[k + 1]),
        *col[k + 2 : k + 8],
        ttft=col[k + 8],
        harm=col[k + 9],
        tpot=col[k + 10],
        bonus=col[k + 11],
    )


def _scores_from(candidates: Sequence[EngineKey], columns: bytes) -> Callable[[], list[Score]]:
    """What makes the scores of a scan's ``columns`` when they are first read."""

    def make() -> list[Score]:
        col = array("d")
        col.frombytes(columns)
        steps = range(0, len(col), _COLUMNS)
        return [_score_of(engine, col, k) for engine, k in zip(candidates, steps, strict=False)]

    return make


def _score_at(candidates: Sequence[EngineKey], columns: bytes, k: int) -> Score:
    """The ``Score`` of candidate ``k`` of a scan."""
    row = array("d")
    row.frombytes(columns[k * _COLUMNS * 8 : (k + 1) * _COLUMNS * 8])
    return _score_of(candidates[k], row, 0)


def _busy(utilization: float, most: float) -> float:
    """What a prefill of one second there costs the requests that arrive behind it, in
    seconds: ``u / (1 - u)`` at prefill utilization ``u`` (an M/G/1 queue's delay per
    unit of work), at most ``most``."""
    if utilization <= 0.0:
        return 0.0
    if utilization >= 1.0:
        return most
    return min(utilization / (1.0 - utilization), most)


def _near(value: float, mid: float, low: float, high: float) -> float:
    """``mid`` when ``value`` is within ``[low, high]`` times it, else ``value``."""
    return mid if mid > 0 and low <= value / mid <= high else value


def _violation(score: Score, slo_ttft: float | None, slo_tpot: float | None) -> float:
    """How far the predictions miss the objectives, relative to each (0: both met)."""
    miss = 0.0
    if slo_ttft is not None and score.ttft > slo_ttft:
        miss += score.ttft / slo_ttft - 1.0
    if slo_tpot is not None and score.tpot > slo_tpot:
        miss += score.tpot / slo_tpot - 1.0
    return miss


__all__ = ["LatencyPolicy", "priors_of"]
