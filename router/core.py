"""The routing core: index lookup, policy decision, provisional bookkeeping.

Every front end (HTTP, gRPC, ext_proc) and the cluster simulator route through
:class:`RoutingCore`, so a request and a state give the same decision everywhere. The
core does no network I/O of its own beyond the index backend.

After each decision under an index-using policy, the chosen engine is recorded as a
*provisional* holder of the prompt's blocks for ``provisional_ttl_s``: requests that
share the prefix and arrive before the engine's KV events follow the first one (and
the load it added spreads them once that engine is busier than a recompute costs).
Engines that publish no KV events are tracked from decisions alone, for
``approximate_ttl_s``. With the Redis backend the record is queued and written in the
background (``router/index/shadow.py``): a decision waits for one round trip, the
lookup, and a lookup Redis cannot answer within its budget is answered from the
router's own recent decisions. A decision made without the index's answer says so in
its reason (``index=shadow:over_budget``, ``index=skipped:unreachable``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router.config import PolicyConfig
from router.fleet.load import LoadTracker
from router.index.base import FallbackMatches, IndexUnavailable, KVIndex, Match
from router.metric_catalogue import (
    DECISIONS,
    INDEX_AVAILABLE,
    INDEX_ERRORS,
    INFLIGHT_REQUESTS,
    SLO_REQUESTS,
    SLO_UNMET,
)
from router.policy import make_policy
from router.policy.base import Decision, NoCandidates, Policy, RouteRequest
from router.policy.kv_cost import KVCostPolicy
from router.policy.latency import priors_of
from router.types import EngineKey

if TYPE_CHECKING:
    from router.flow.isolation import PrefillIsolation
    from router.index.shadow import ShadowedIndex
    from router.metric_catalogue import StateFamily

log = logging.getLogger("kvroute.core")


@dataclass(slots=True)
class CoreCounters:
    """What the core did, for metrics."""

    decisions: dict[tuple[str, str], int] = field(default_factory=dict)
    """Decisions by (policy, reason)."""
    index_errors: int = 0


class Saturated(NoCandidates):
    """Every candidate engine is at its in-flight limit (wait for room, then 429)."""


class RoutingCore:
    """Routes one request at a time against a shared index and load view."""

    def __init__(
        self,
        index: KVIndex,
        policy: Policy,
        config: PolicyConfig,
        loads: LoadTracker,
        *,
        has_events: Callable[[EngineKey], bool] = lambda engine: True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.policy = policy
        self.config = config
        self.loads = loads
        self.has_events = has_events
        self.clock = clock
        self.counters = CoreCounters()
        self.max_per_engine = 0
        """Requests in flight an engine may hold before it stops being a candidate
        (0: no limit; ``limits.max_inflight_per_engine``)."""
        self.isolation: PrefillIsolation | None = None
        """Prefill isolation (``flow.prefill_isolation``): leaves out engines prefilling
        requests that outrank this one."""

    def reconfigure(self, config: PolicyConfig, max_per_engine: int) -> None:
        """Apply a reloaded ``policy`` section and in-flight limit. New weights keep the
        policy object and its state; another policy (or new ``sglang`` settings) gets a
        new one. Decisions already made keep what they were made with."""
        if config != self.config:
            same = config.name == self.config.name and config.sglang == self.config.sglang
            if not same:
                self.policy = make_policy(config, self.clock)
            elif isinstance(self.policy, KVCostPolicy):
                self.policy.config = config  # its weights are read per decision
            self.config = config
            if self.loads.latency is not None:
                self.loads.latency.reconfigure(priors_of(config))  # keeps what it learnt
        self.max_per_engine = max_per_engine

    async def lookup(
        self, keys: Sequence[int], candidates: Sequence[EngineKey], policy: Policy | None = None
    ) -> Mapping[EngineKey, Match]:
        """Match depths, or none at all if the index cannot answer (route on load; the
        Redis backend answers from its shadow instead of failing)."""
        if not keys or not (policy or self.policy).uses_index:
            return {}
        try:
            return await self.index.lookup(keys, candidates)
        except IndexUnavailable as exc:
            self.counters.index_errors += 1
            log.debug("index lookup failed, routing on load alone: %s", exc)
            return FallbackMatches({}, f"skipped:{exc.why}")

    async def route(
        self,
        request: RouteRequest,
        candidates: Sequence[EngineKey],
        policy: Policy | None = None,
    ) -> Decision:
        """Pick an engine for ``request`` among ``candidates`` and record the choice.

        ``policy`` overrides the router's policy for this choice (decode engines of a
        disaggregated pool are chosen by their own cost). Candidates with
        ``max_per_engine`` requests in flight are skipped; :class:`Saturated` if all are.
        With prefill isolation, so are engines prefilling a request that outranks this
        one (:class:`~router.flow.isolation.Yielding` if all are and it may wait).
        """
        if not candidates:
            raise NoCandidates("no engine can take this request")
        cap = self.max_per_engine
        if cap:
            view = self.loads.view
            room = [c for c in candidates if (load := view.get(c)) is None or load.requests < cap]
            if not room:
                raise Saturated(
                    f"all {len(candidates)} candidate engine(s) have {cap} requests in flight"
                )
            candidates = room
        if request.flow is not None and self.isolation is not None and policy is None:
            # Not for a disaggregated pool's decode engine (``policy`` given): a split
            # prefills elsewhere, and its prefill engine is chosen with isolation.
            candidates = self.isolation.clear(request, candidates)
        policy = policy or self.policy
        matches = await self.lookup(request.keys, candidates, policy)
        decision = policy.choose(request, candidates, matches, self.loads.view)
        if request.by_load and decision.reason == "no_prefix":
            decision.reason = "load"
        if isinstance(matches, FallbackMatches):
            decision.index = matches.note  # the reason says the index did not answer
        key = (decision.policy, decision.reason)
        self.counters.decisions[key] = self.counters.decisions.get(key, 0) + 1
        if policy.uses_index:
            await self.record(decision.engine, request.keys, request.approximate)
        return decision

    async def record(
        self, engine: EngineKey, keys: Sequence[int], approximate: bool = False
    ) -> None:
        """Note that ``engine`` is about to hold ``keys`` (expiring until confirmed).
        Never waits for Redis: the Redis backend queues the write."""
        if not keys:
            return
        confirmable = not approximate and self.has_events(engine)
        ttl = self.config.provisional_ttl_s if confirmable else self.config.approximate_ttl_s
        try:
            await self.index.add(engine, keys, ttl=ttl)
        except IndexUnavailable as exc:
            self.counters.index_errors += 1
            log.debug("could not record a provisional holder: %s", exc)

    def forget(self, engine: EngineKey) -> None:
        """An engine left the fleet: drop policy state and load about it."""
        self.policy.forget(engine)
        self.loads.forget(engine)

    def metric_families(self, shadowed: ShadowedIndex | None = None) -> Iterator[StateFamily]:
        """Decisions, index errors (with those of the Redis index's ``shadowed`` calls),
        requests in flight, and the ``latency`` policy's objectives when it is the
        policy."""
        counters = self.counters
        yield DECISIONS.labelled(sorted(counters.decisions.items()))
        errors = counters.index_errors + (shadowed.counters.errors if shadowed is not None else 0)
        yield INDEX_ERRORS.value(errors)
        yield INDEX_AVAILABLE.value(1.0 if shadowed is None or shadowed.available else 0.0)
        yield INFLIGHT_REQUESTS.value(self.loads.in_flight)
        checked = getattr(self.policy, "slo_checked", None)
        if checked is not None:
            yield SLO_REQUESTS.value(checked)
            yield SLO_UNMET.value(getattr(self.policy, "slo_unmet", 0))


__all__ = ["NoCandidates", "RoutingCore", "Saturated"]
