"""A re-implementation of sglang-router's ``cache_aware`` policy, as a reference point.

The rule, as sglang-router applies it (``policies/cache_aware.rs``):

* load is each engine's in-flight request count as the router sees it; the fleet is
  *imbalanced* when ``max - min > balance_abs_threshold`` **and**
  ``max > min * balance_rel_threshold``; then the least-loaded engine wins;
* otherwise the request's longest prefix match in an approximate tree of routing
  history wins if it covers more than ``cache_threshold`` of the prompt, else the
  engine with the fewest requests in flight (the first of them on a tie), as 0.3.2
  does (``select_worker``'s low-match branch; releases before December 2025 took the
  engine with the smallest tree, which spread prefill work instead of requests);
* the chosen engine's tree gets the prompt inserted either way; trees are trimmed to
  ``max_tree_size`` by LRU every ``eviction_interval_s``.

One deliberate difference: sglang's tree holds characters of the prompt text; this one
holds the router's block keys, because kvroute (and its simulator) route on tokens. The
match rate is therefore measured in whole blocks. No KV events are used.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from router.fleet.load import LoadView, load_of
from router.index.base import Match
from router.policy.base import Decision, Policy, RouteRequest
from router.policy.registry import PolicyConfig
from router.policy.sglang_config import SGLangCacheAwareConfig
from router.types import EngineKey


class CacheAwareSGLang(Policy):
    """sglang-router's cache_aware rule over an approximate per-engine prefix tree."""

    name = "cache_aware_sglang"

    @classmethod
    def from_config(cls, config: PolicyConfig, clock: Callable[[], float]) -> CacheAwareSGLang:
        return cls(config.sglang, clock)

    def __init__(
        self, config: SGLangCacheAwareConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._clock = clock
        self._holders: dict[int, dict[EngineKey, float]] = {}
        self._lru: dict[EngineKey, OrderedDict[int, None]] = {}
        self._last_eviction = clock()

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[EngineKey],
        matches: Mapping[EngineKey, Match],
        loads: LoadView,
    ) -> Decision:
        cfg = self.config
        now = self._clock()
        counts = [load_of(loads, e).requests for e in candidates]
        hi, lo = max(counts), min(counts)
        depth = 0
        if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
            engine = candidates[counts.index(lo)]
            reason = "balance"
        else:
            depth, holder = self._match(request.keys, candidates)
            rate = (
                depth * request.block_size / request.prompt_tokens if request.prompt_tokens else 0
            )
            if holder is not None and rate > cfg.cache_threshold:
                engine, reason = holder, "cache_hit"
            else:
                engine = candidates[counts.index(lo)]
                reason = "min_load"
                depth = 0
        self._insert(request.keys, engine, now)
        if now - self._last_eviction >= cfg.eviction_interval_s:
            self._evict(cfg.max_tree_size // max(request.block_size, 1))
            self._last_eviction = now
        return Decision(engine, self.name, reason, matched_blocks=depth)

    def _match(
        self, keys: Sequence[int], candidates: Sequence[EngineKey]
    ) -> tuple[int, EngineKey | None]:
        """Deepest prefix any candidate's tree holds, and the most recent such candidate."""
        allowed = set(candidates)
        depth, holder = 0, None
        for pos, key in enumerate(keys):
            holders = self._holders.get(key)
            if not holders:
                break
            present = [(t, e) for e, t in holders.items() if e in allowed]
            if not present:
                break
            depth, holder = pos + 1, max(present)[1]
        return depth, holder

    def _insert(self, keys: Sequence[int], engine: EngineKey, now: float) -> None:
        lru = self._lru.setdefault(engine, OrderedDict())
        # Deepest first, so the root ends most recent and eviction trims leaves first.
        for key in reversed(keys):
            self._holders.setdefault(key, {})[engine] = now
            lru[key] = None
            lru.move_to_end(key)

    def _evict(self, max_blocks: int) -> None:
        for engine, lru in self._lru.items():
            while len(lru) > max_blocks:
                key, _ = lru.popitem(last=False)
                holders = self._holders.get(key)
                if holders is not None:
                    holders.pop(engine, None)
                    if not holders:
                        del self._holders[key]

    def forget(self, engine: EngineKey) -> None:
        for key in self._lru.pop(engine, ()):
            holders = self._holders.get(key)
            if holders is not None:
                holders.pop(engine, None)
                if not holders:
                    del self._holders[key]
