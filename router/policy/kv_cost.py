"""The default policy: the engine that will serve the prompt soonest, cache included.

Per candidate, in KV blocks (lower wins)::

    queue    = queue_weight   * prefill tokens already queued on the engine / block_size
    prefill  = prefill_weight * (prompt_tokens - cached_tokens) / block_size
    decode   = decode_weight  * blocks held by the engine's decoding requests
    reported = waiting_weight * reported_waiting + running_weight * reported_running
               + kv_usage_weight * reported_kv_usage
    transfer = prefill_weight * transfer tokens to the decode engine / block_size
    cost     = queue + prefill + decode + reported + transfer

``cached_tokens`` is the match depth, each block at its best tier (GPU 1, CPU
``offload_weight``, disk/remote ``disk_weight``), capped by the engine's
never-the-last-token rule. ``transfer`` is there only when a prefill engine is chosen
for a decode engine with topology known (``RouteRequest.transfer_tokens``): the
handoff's seconds counted as the prompt tokens a prefill does in that time, so a prefill
engine further away wins exactly when its cache saves more prefill than its longer
transfer costs.

Decode load weighs a quarter of a prefill block by default (``decode_weight`` 0.25): a
decoding sequence shares each engine step with a newcomer rather than queueing ahead of
it, so it delays a first token far less than queued prefill, but it is the load that
stays with an engine for a conversation's every later turn. 1.0 scattered same-prefix
bursts; on the simulator, 0.25 beat 0.5 on multi-turn chat (TTFT mean 55 vs 73 ms,
conversations within 1.01x of the mean) and on both Mooncake traces (higher hit rate,
lower TTFT), which a live chat run confirmed (docs/benchmarks.md, docs/simulator.md).

The request's own uncached work counts twice by default (``prefill_weight`` 2 against
``queue_weight`` 1): the request waits for it, and so does everything queued behind
it on that engine. With equal weights (Dynamo's cost) the second request of a
same-prefix burst goes to an idle engine and recomputes the whole prefix, because the
first one's prefill is still queued where the prefix will be; counting the externality
keeps a burst together until the queue really costs more than the recompute, then
spreads it. Load stays part of every decision, which is what keeps a workload whose
prompts all share their first block from piling onto one engine. Engine-reported terms
are off by default (the router's own accounting is fresher) and ignored once older
than ``report_max_age_s``; the decode choice of a disaggregated pool weighs them a
little by default (:class:`DecodeCostPolicy`).
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from typing import Any

from router.fleet.load import EngineLoad, LoadView
from router.hashing import cacheable_blocks, native_helper
from router.index.base import Match
from router.policy.base import (
    Decision,
    LazyScores,
    Policy,
    RouteRequest,
    Score,
    request_seed,
    tiebreak,
)
from router.policy.registry import PolicyConfig
from router.types import EngineKey

_TOTAL = attrgetter("total")
_MATCHED = attrgetter("matched_blocks")
_SCAN: Any = getattr(native_helper(), "kv_cost_scan", None)
"""The compiled twin of :meth:`KVCostPolicy.score`'s loop (router/native/cost.c)."""
_COLUMNS = 8


def tier_discounts(cfg: PolicyConfig) -> tuple[float, float]:
    """What a cached block loses in an offload tier (``1 - offload_weight``) and, beyond
    that, in a disk tier (``offload_weight - disk_weight``; 0 when disk weighs as CPU)."""
    disk_extra = 0.0 if cfg.disk_weight is None else cfg.offload_weight - cfg.disk_weight
    return 1.0 - cfg.offload_weight, disk_extra


def report_cutoff(cfg: PolicyConfig, now: float) -> float | None:
    """Engine reports older than this are ignored; None when every report weight is 0."""
    if cfg.waiting_weight or cfg.running_weight or cfg.kv_usage_weight:
        return now - cfg.report_max_age_s
    return None


def cached_tokens(
    match: Match, block_size: int, cap: int, offload_discount: float, disk_extra: float
) -> int:
    """The prompt tokens ``match`` serves from cache, each block at its best tier's
    worth (an offloaded block ``1 - offload_discount``, a disk block ``disk_extra``
    less), capped at ``cap`` (the never-the-last-token rule)."""
    held: float = match.blocks
    if match.offloaded:
        held -= match.offloaded * offload_discount
        if match.disk:
            held -= match.disk * disk_extra
    cached = int(held * block_size + 1e-6)  # 1e-6: weights' float error
    return cap if cached > cap else cached


def reported_load(
    load: EngineLoad, fresh_after: float | None, ww: float, wr: float, wk: float
) -> float:
    """The engine-reported terms (waiting, running, KV usage) in block-equivalents, or
    0 when they are off (``fresh_after`` None) or older than ``fresh_after``."""
    if fresh_after is None or load.reported_at is None or load.reported_at < fresh_after:
        return 0.0
    return ww * (load.waiting or 0.0) + wr * (load.running or 0.0) + wk * (load.kv_usage or 0.0)


def _score(engine: EngineKey, col: array[float], k: int) -> Score:
    """The ``Score`` of the scan's row starting at ``col[k]`` (matched blocks, cached
    tokens, queue, prefill, decode, reported, total, transfer)."""
    return Score(engine, int(col[k]), int(col[k + 1]), *col[k + 2 : k + _COLUMNS])


def _scores_from(candidates: Sequence[EngineKey], columns: bytes) -> Callable[[], list[Score]]:
    """What makes the scores of a scan's ``columns`` (8 doubles per candidate) when
    they are first read."""

    def make() -> list[Score]:
        col = array("d")
        col.frombytes(columns)
        steps = range(0, len(col), _COLUMNS)
        return [_score(engine, col, k) for engine, k in zip(candidates, steps, strict=False)]

    return make


class KVCostPolicy(Policy):
    """Cache affinity weighed against queued prefill and decode load."""

    name = "kv_cost"
    uses_index = True

    @classmethod
    def from_config(cls, config: PolicyConfig, clock: Callable[[], float]) -> KVCostPolicy:
        return cls(config, clock)

    def __init__(self, config: PolicyConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock

    def _terms(self, request: RouteRequest) -> tuple[Any, ...]:
        """The per-request constants of :meth:`score`, for the compiled scan."""
        cfg = self.config
        bs = request.block_size
        isl = request.prompt_tokens
        return (
            bs,
            isl,
            cacheable_blocks(isl, bs) * bs,
            cfg.queue_weight / bs,
            cfg.prefill_weight / bs,
            cfg.decode_weight,
            *tier_discounts(cfg),
            cfg.waiting_weight,
            cfg.running_weight,
            cfg.kv_usage_weight,
            report_cutoff(cfg, self._clock()),
        )

    def score(
        self,
        request: RouteRequest,
        candidates: Sequence[EngineKey],
        matches: Mapping[EngineKey, Match],
        loads: LoadView,
    ) -> list[Score]:
        """Every candidate's cost terms (the hot path: keep it lean)."""
        cfg = self.config
        bs = request.block_size
        isl = request.prompt_tokens
        cap = cacheable_blocks(isl, bs) * bs
        per_queued = cfg.queue_weight / bs
        per_uncached = cfg.prefill_weight / bs
        per_decode_block = cfg.decode_weight
        offload_discount, disk_extra = tier_discounts(cfg)
        ww, wr, wk = cfg.waiting_weight, cfg.running_weight, cfg.kv_usage_weight
        fresh_after = report_cutoff(cfg, self._clock())
        transfers = request.transfer_tokens
        get_match, get_load = matches.get, loads.get
        scores = []
        append = scores.append
        for engine in candidates:
            match = get_match(engine)
            if match is None:
                blocks = cached = 0
            else:
                blocks = match.blocks
                cached = cached_tokens(match, bs, cap, offload_discount, disk_extra)
            prefill = per_uncached * (isl - cached)
            transfer = per_uncached * transfers.get(engine, 0.0) if transfers else 0.0
            load = get_load(engine)
            if load is None:
                total = prefill + transfer
                append(Score(engine, blocks, cached, 0.0, prefill, 0.0, 0.0, total, transfer))
                continue
            queue = per_queued * load.prefill_tokens
            decode = per_decode_block * load.decode_blocks
            reported = reported_load(load, fresh_after, ww, wr, wk)
            append(
                Score(
                    engine,
                    blocks,
                    cached,
                    queue,
                    prefill,
                    decode,
                    reported,
                    queue + prefill + decode + reported + transfer,
                    transfer,
                )
            )
        return scores

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
            and type(self).score is KVCostPolicy.score
            and isinstance(matches, dict)
            and isinstance(loads, dict)
            and (request.transfer_tokens is None or isinstance(request.transfer_tokens, dict))
        ):
            return self._choose_scanned(request, candidates, matches, loads)
        scores = self.score(request, candidates, matches, loads)
        if self.config.temperature > 0 and len(scores) > 1:
            chosen = self._sample(request, scores)
        else:
            best = min(map(_TOTAL, scores))
            tied = [s for s in scores if s.total - best <= 1e-9]
            chosen = (
                tied[0]
                if len(tied) == 1
                else min(tied, key=lambda s: self._tie_rank(request, s, loads))
            )
        deepest = max(map(_MATCHED, scores))
        return self._decision(chosen, deepest, scores)

    def _choose_scanned(
        self,
        request: RouteRequest,
        candidates: Sequence[EngineKey],
        matches: dict[EngineKey, Match],
        loads: dict[EngineKey, Any],
    ) -> Decision:
        """:meth:`choose` at temperature 0 from the compiled scan: the same terms, the
        same choice; ``Score`` objects only for tied candidates and the chosen one
        (the rest when a caller reads ``Decision.scores``)."""
        candidates = tuple(candidates)
        tied, deepest, columns = _SCAN(
            candidates, matches, loads, request.transfer_tokens, self._terms(request)
        )
        scores = LazyScores(_scores_from(candidates, columns), len(candidates))
        if len(tied) == 1:
            chosen = self._score_at(candidates, columns, tied[0])
        else:
            chosen = min(
                (self._score_at(candidates, columns, k) for k in tied),
                key=lambda s: self._tie_rank(request, s, loads),
            )
        return self._decision(chosen, deepest, scores)

    def _decision(self, chosen: Score, deepest: int, scores: Sequence[Score]) -> Decision:
        """The decision for ``chosen``, with the reason its match depth against the
        deepest gives."""
        if deepest == 0:
            reason = "no_prefix"
        elif chosen.matched_blocks == deepest:
            reason = "prefix_hit"
        else:
            reason = "load_over_prefix"
        return Decision(
            engine=chosen.engine,
            policy=self.name,
            reason=reason,
            matched_blocks=chosen.matched_blocks,
            cached_tokens=chosen.cached_tokens,
            scores=scores,
            chosen_score=chosen,
        )

    @staticmethod
    def _score_at(candidates: Sequence[EngineKey], columns: bytes, k: int) -> Score:
        """The ``Score`` of candidate ``k`` of a scan."""
        row = array("d")
        row.frombytes(columns[k * _COLUMNS * 8 : (k + 1) * _COLUMNS * 8])
        return _score(candidates[k], row, 0)

    @staticmethod
    def _tie_rank(request: RouteRequest, score: Score, loads: LoadView) -> tuple[float, ...]:
        """Equal costs: fewer requests in flight, then the engine routed to least recently
        (its cache is the coldest, so a fresh prefix finds room there; over time this
        spreads fresh prefixes like round robin), then a hash of the request id."""
        load = loads.get(score.engine)
        if load is None:
            return (0, 0, tiebreak(request.request_id, score.engine))
        return (load.requests, load.routed, tiebreak(request.request_id, score.engine))

    def _sample(self, request: RouteRequest, scores: list[Score]) -> Score:
        """Softmax over min-max normalised costs at the configured temperature."""
        lo = min(s.total for s in scores)
        hi = max(s.total for s in scores)
        span = hi - lo or 1.0
        weights = [math.exp(-((s.total - lo) / span) / self.config.temperature) for s in scores]
        point = (request_seed(request.request_id) / 2**64) * sum(weights)
        for score, weight in zip(scores, weights, strict=True):
            point -= weight
            if point < 0:
                return score
        return scores[-1]


class DecodeCostPolicy(KVCostPolicy):
    """The same cost, weighted for choosing a decode engine of a disaggregated pool.

    Decode engines are memory-bound: their decode load weighs fully, and the blocks of
    the prompt they lack (what they must pull or prefill) weigh less than on a prefill
    engine, though they still steer multi-turn chats back to the engine holding them.
    Engine-reported KV usage and running/waiting requests count a little
    (``disaggregation.decode_kv_usage_weight`` and the like): they see traffic this
    router does not, but are as old as the last scrape and count this router's own
    requests a second time, so they break near-ties rather than decide.
    """

    name = "decode_cost"

    @classmethod
    def for_disaggregation(
        cls,
        base: PolicyConfig,
        decode_weight: float,
        queue_weight: float,
        prefix_weight: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        waiting_weight: float | None = None,
        running_weight: float | None = None,
        kv_usage_weight: float | None = None,
    ) -> DecodeCostPolicy:
        """The decode policy: ``base`` with the decode weights; the engine-reported
        weights replace ``base``'s when given."""
        update: dict[str, float] = {
            "decode_weight": decode_weight,
            "queue_weight": queue_weight,
            "prefill_weight": prefix_weight,
            "temperature": 0.0,
        }
        for name, value in (
            ("waiting_weight", waiting_weight),
            ("running_weight", running_weight),
            ("kv_usage_weight", kv_usage_weight),
        ):
            if value is not None:
                update[name] = value
        return cls(base.model_copy(update=update), clock)
