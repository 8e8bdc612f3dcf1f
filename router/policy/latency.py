"""The ``latency`` policy: the engine with the lowest predicted latency cost.

Per candidate, in seconds, from the engine's fitted latency lines
(:mod:`router.engines.latency`: ``a`` seconds per prefill token, ``b`` seconds of
first-token overhead, the TPOT line) or the configured priors (lower total wins)::

    ttft     = b + a * (queued prefill tokens + uncached prompt tokens) + transfer seconds
    queue    = queue_weight   * a * queued prefill tokens
    prefill  = prefill_weight * a * uncached prompt tokens   (idle_prefill_weight, when
               set, on an engine with nothing in flight)
    transfer = prefill_weight * the transfer's seconds (a split's prefill, topology known)
    decode   = decode_weight  * a * block_size * blocks held by decoding requests
    reported = (kv_cost's engine-reported terms, in blocks) * a * block_size
    harm     = itl_weight * a * uncached prompt tokens * requests there (``harm_counts``)
    tpot     = the TPOT line at the sequences decoding there, plus this one
    total    = b + queue + prefill + transfer + decode + reported + harm - session bonus

It is ``kv_cost`` measured in each engine's own seconds, plus two things ``kv_cost``
cannot see: the **decode harm** (every chunk of a prefill lengthens the step of each
sequence decoding on that engine, so a long prompt is worth placing where few are
decoding) and the engines' **own speed** (a slower engine's queue costs more). The
weights are ``kv_cost``'s (``prefill_weight`` 2 counts the request's prefill once for
itself and once for what queues behind it); ``itl_weight`` is this policy's.

**Idle engines.** ``idle_prefill_weight`` (unset: ``prefill_weight``) prices the
request's prefill on an engine with nothing in flight from this router or its peers
(``requests`` 0), whose time would otherwise be spent on nothing. At 1 a recompute there
costs only the request's own wait: 16 chats opening at once on 4 idle engines with a new
system prompt split 4/4/4/4 instead of queueing five deep behind the engines computing
it (5/5/5/1), which cuts that burst's TTFT tail, but on traces it copies prefixes onto
engines that fall idle for a moment and lowers the hit rate (docs/benchmarks.md, "The
first burst of multi-turn chat").

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

Ties break as ``kv_cost``'s (fewer requests in flight, least recently routed, a hash of
the request id); ``temperature`` > 0 samples as ``kv_cost`` does.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence

from router.config import PolicyConfig
from router.engines.latency import LatencyPriors
from router.engines.load import LoadView
from router.hashing import cacheable_blocks
from router.index.base import Match
from router.policy.base import Decision, RouteRequest, Score
from router.policy.kv_cost import (
    KVCostPolicy,
    cached_tokens,
    report_cutoff,
    reported_load,
    tier_discounts,
)
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
        idle = cfg.prefill_weight if lat.idle_prefill_weight is None else lat.idle_prefill_weight
        scores: list[Score] = []
        for engine in candidates:
            match = matches.get(engine)
            blocks = cached = 0
            if match is not None:
                blocks = match.blocks
                cached = cached_tokens(match, bs, cap, offload_discount, disk_extra)
            uncached = isl - cached
            moved = transfers.get(engine, 0.0) if transfers else 0.0
            load = loads.get(engine)
            a, b, tpot_base, tpot_seq = speeds[engine]
            queued = decode_blocks = decoding = requests = 0
            reported = 0.0
            if load is not None:
                queued, decode_blocks, decoding, requests = (
                    load.prefill_tokens,
                    load.decode_blocks,
                    load.decoding,
                    load.requests,
                )
                reported = reported_load(load, fresh_after, ww, wr, wk) * a * bs
            if backlog and load is not None and load.latency is not None:
                # The router's own queue as the backlog clock says (work in progress
                # counts what is left of it), the peers' at the fitted speed.
                wait = max(load.backlog_until - now, 0.0) + a * load.peer_prefill_tokens
            else:
                wait = a * queued
            queue = cfg.queue_weight * wait
            prefill = (cfg.prefill_weight if requests else idle) * a * uncached
            transfer_s = moved * per_moved if per_moved is not None else a * moved
            transfer = cfg.prefill_weight * transfer_s
            decode = cfg.decode_weight * a * bs * decode_blocks
            # Those ahead of it in the queue decode by the time its chunks run.
            harm = lat.itl_weight * a * uncached * (decoding if by_decoding else requests)
            ttft = b + wait + a * uncached + transfer_s
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
    ) -> dict[EngineKey, tuple[float, float, float, float]]:
        """Each candidate's (prefill s/token, TTFT overhead s, TPOT base s, TPOT s/seq).

        A fitted coefficient within a factor ``1 + speed_tolerance`` of the
        candidates' lower median is taken as that median: fits of alike engines differ
        by their noise, and ranking on that noise would scatter prefixes the cache
        should keep together. An engine really slower (or faster) keeps its own. The
        first-token overhead is always the median: the fit's intercept is its noisiest
        term (a slow engine's shows in its slope, where the fit puts it), and a few
        milliseconds of it would otherwise decide between alike engines."""
        tol = self.config.latency.speed_tolerance
        prior: LatencyPriors | None = None  # for engines never timed (no model: tests)
        rows: dict[EngineKey, tuple[float, float, float, float]] = {}
        for engine in candidates:
            load = loads.get(engine)
            fit = load.latency if load is not None else None
            if fit is not None:
                rows[engine] = (
                    fit.prefill_s_per_token,
                    fit.ttft_overhead_s,
                    fit.tpot_base_s,
                    fit.tpot_s_per_seq,
                )
                continue
            prior = prior or priors_of(self.config)
            rows[engine] = (
                prior.prefill_s_per_token,
                prior.ttft_overhead_s,
                prior.tpot_base_s,
                prior.tpot_s_per_seq,
            )
        if len(rows) < 2:
            return rows
        # The lower median: with two candidates (or two groups) the faster one's own
        # value, so a slower one stands out instead of both being averaged.
        medians = [statistics.median_low(col) for col in zip(*rows.values(), strict=True)]
        low, high = 1.0 / (1.0 + tol), 1.0 + tol
        overhead = medians[1]
        return {
            engine: (
                _near(row[0], medians[0], low, high),
                overhead,
                _near(row[2], medians[2], low, high),
                _near(row[3], medians[3], low, high),
            )
            for engine, row in rows.items()
        }

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[EngineKey],
        matches: Mapping[EngineKey, Match],
        loads: LoadView,
    ) -> Decision:
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
            tied = [s for s in pool if s.total - best <= 1e-12]
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
