"""The request plan: which engines serve one request, decided the same way everywhere.

For an aggregated pool the plan is one engine, the routing core's choice. For a model
served by prefill and decode pools it is three steps: the decode engine, chosen first
by its own cost (the decode policy, match depth in view); then
:func:`~router.policy.disagg.decide_split` says whether a prefill engine is worth it;
then the prefill engine, chosen by the router's policy. With engine topology known
(:mod:`router.topology`), the split is priced over the best link from the decode engine
to a prefill engine it may pair with, prefill engines behind a link slower than
``disaggregation.min_link_bandwidth_gb_s`` are no candidates, and each candidate's cost
includes the transfer to that decode engine (:class:`Transfers`, which the split hands
to the prefill choice as ``RouteRequest.transfer_tokens``; the request itself is never
written to). The HTTP
API, gRPC ``Pick`` and ``Generate``, ext_proc and the cluster simulator all call
:class:`Planner`, so the same request and state give the same engines on every front end.
A front end that retries calls the same steps again with the failed engines excluded
(``plan(exclude=...)``, ``prefill(exclude=..., transfers=plan.transfers)``).

The planner knows no application object: it takes the candidate pools (the
:class:`Pools` protocol: the router's registry, or the simulator's fleet), the routing
core, the decode policy, the disaggregation settings, the dialect of each model, and
how to wait when every candidate is full (:data:`WaitForRoom`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, replace
from typing import Protocol

from router.admission import Overloaded
from router.config import DisaggregationConfig
from router.core import RoutingCore, Saturated
from router.policy.base import Decision, NoCandidates, Policy, RouteRequest
from router.policy.disagg import SplitDecision, decide_split
from router.topology import UNKNOWN, Link, Topology, link_between
from router.types import EngineKey

#: Roles of engines that serve a whole request, or its decode leg.
SERVING_ROLES = ("decode", "both")


class Pools(Protocol):
    """The engines a plan chooses among (the router's registry satisfies it)."""

    def candidates(
        self, model: str, roles: tuple[str, ...] = ("both",), exclude: Iterable[str] = ()
    ) -> list[EngineKey]:
        """Healthy engines serving ``model`` in one of ``roles``, minus ``exclude``
        (endpoints)."""
        ...

    def is_disaggregated(self, model: str) -> bool:
        """Whether ``model`` is served by prefill and decode pools."""
        ...

    def models(self) -> list[str]:
        """Every model some engine serves."""
        ...


#: Called when every candidate is at its in-flight limit: returns once there may be
#: room (the choice is tried again), raises :class:`Overloaded` when the request may
#: wait no longer.
WaitForRoom = Callable[[RouteRequest, Saturated], Awaitable[None]]


async def refuse(route: RouteRequest, full: Saturated) -> None:
    """The :data:`WaitForRoom` of a caller that never waits."""
    raise Overloaded(str(full))


@dataclass(frozen=True, slots=True)
class Transfers:
    """What moving the KV to the decode engine costs each prefill engine that may pair
    with it (topology known): the prefill choice weighs it, and leaves out engines
    without an entry (behind a link too slow)."""

    tokens: dict[EngineKey, float]
    """Per prefill engine, the transfer in prompt tokens' worth of prefill (transfer
    seconds over ``disaggregation.prefill_s_per_token``); a dict, which the cost
    policies' compiled scans take as it is."""
    s_per_token: float
    """What one of ``tokens`` is in seconds (the ``latency`` policy prices in seconds)."""

    def candidates(self, pool: Iterable[EngineKey]) -> list[EngineKey]:
        """The engines of ``pool`` that may pair with the decode engine."""
        return [key for key in pool if key in self.tokens]

    def route(self, route: RouteRequest) -> RouteRequest:
        """``route`` as the prefill choice sees it: a copy carrying the transfers."""
        return replace(route, transfer_tokens=self.tokens, transfer_s_per_token=self.s_per_token)


@dataclass(frozen=True, slots=True)
class SplitOutcome:
    """What :meth:`Planner.split` decided, handed on to the prefill choice."""

    decision: SplitDecision
    transfers: Transfers | None = None
    """With topology known, what the prefill choice weighs; None: every link alike."""


@dataclass(slots=True)
class Plan:
    """Where one request goes, with every reason."""

    model: str
    route: RouteRequest
    decode: Decision
    """The engine that serves the request (its decode leg when split)."""
    load_tokens: int
    """Prompt tokens the serving engine's load counts: every prompt, times ``n``."""
    split: SplitDecision | None = None
    """Disaggregated pools only: whether a prefill engine takes the prefill."""
    prefill: Decision | None = None
    """The prefill engine, when split."""
    dialect: str | None = None
    """Disaggregated pools only: the handoff dialect (:mod:`router.handoff.registry`)."""
    transfers: Transfers | None = None
    """With topology known, what the split handed to the prefill choice (a retried
    prefill choice takes it again: :meth:`Planner.prefill`)."""

    @property
    def mode(self) -> str:
        """``aggregated``, ``local`` (a disaggregated pool served by one engine) or ``split``."""
        if self.split is None:
            return "aggregated"
        return "split" if self.split.split else "local"

    @property
    def reason(self) -> str:
        """Why the plan has this shape: the decision's reason, or the split's."""
        return self.decode.reason if self.split is None else self.split.reason


def restrict(candidates: list[EngineKey], subset: Collection[str] | None) -> list[EngineKey]:
    """The candidates whose endpoint (``host:port``) is in ``subset`` (all when None)."""
    if subset is None:
        return candidates
    return [key for key in candidates if key.endpoint in subset]


class Planner:
    """Candidate selection, the policy decisions and the disaggregation split."""

    def __init__(
        self,
        pools: Pools,
        core: RoutingCore,
        decode_policy: Policy,
        disaggregation: DisaggregationConfig,
        dialect_of: Callable[[str], str],
        *,
        wait: WaitForRoom = refuse,
        on_split: Callable[[SplitDecision], None] | None = None,
        locate: Callable[[EngineKey], Topology | None] | None = None,
    ) -> None:
        self.pools = pools
        self.core = core
        self.decode_policy = decode_policy
        self.disaggregation = disaggregation
        self.dialect_of = dialect_of
        """A model's handoff dialect."""
        self.wait = wait
        self.on_split = on_split
        """Sees every split decision (the router counts them)."""
        self.locate = locate
        """Where an engine runs (None, or None for an engine: not known)."""

    def candidates(
        self,
        model: str,
        roles: tuple[str, ...] = ("both",),
        exclude: Iterable[str] = (),
        subset: Collection[str] | None = None,
    ) -> list[EngineKey]:
        """Healthy engines serving ``model`` in ``roles``, minus ``exclude``, within
        ``subset``."""
        return restrict(self.pools.candidates(model, roles, exclude=exclude), subset)

    async def choose(
        self, route: RouteRequest, candidates: list[EngineKey], policy: Policy | None = None
    ) -> Decision:
        """The policy's choice among ``candidates`` (NoCandidates when empty); when all
        are full, waits for room (:data:`WaitForRoom`) and tries again."""
        while True:
            try:
                return await self.core.route(route, candidates, policy)
            except Saturated as full:
                await self.wait(route, full)

    async def plan(
        self,
        model: str,
        route: RouteRequest,
        load_tokens: int,
        subset: Collection[str] | None = None,
        exclude: Iterable[str] = (),
    ) -> Plan:
        """Every engine a request needs, decided once (raises NoCandidates).

        ``subset`` and ``exclude`` limit the engine that serves the request (the
        gateway's destination; engines that failed it); a split's prefill engine comes
        from the whole prefill pool.
        """
        if not self.pools.is_disaggregated(model):
            decision = await self.choose(
                route, self.candidates(model, exclude=exclude, subset=subset)
            )
            return Plan(model, route, decision, load_tokens)
        pool = self.candidates(model, SERVING_ROLES, exclude, subset)
        decode = await self.choose(route, pool, self.decode_policy)
        prefill_pool = self.candidates(model, ("prefill",))
        links = self.links(decode.engine, prefill_pool)
        outcome = self.split(route, decode, prefill_pool, links)
        split, transfers = outcome.decision, outcome.transfers
        prefill = await self.prefill(route, model, transfers=transfers) if split.split else None
        if prefill is not None and links is not None:
            # Priced over the best link; the chosen engine's may be longer (its cache
            # saved more than the difference): the plan says which it took.
            link = links[prefill.engine]
            split = replace(
                split,
                link=link.locality,
                transfer_s=link.transfer_s(split.uncached_tokens, self.disaggregation),
            )
        if links is not None:
            decode.note = self._explain(split, prefill)
        if self.on_split is not None:
            self.on_split(split)
        return Plan(
            model, route, decode, load_tokens, split, prefill, self.dialect_of(model), transfers
        )

    def links(
        self, decode: EngineKey, prefill: Iterable[EngineKey]
    ) -> dict[EngineKey, Link] | None:
        """Each prefill engine's link to ``decode``; None when no link's locality is
        known (no topology: every pair takes ``transfer_bandwidth_gb_s``'s link)."""
        where = self.locate
        at = where(decode) if where is not None else None
        if where is None or at is None:
            return None
        cfg = self.disaggregation
        links = {key: link_between(at, where(key), cfg) for key in prefill}
        return links if any(link.locality != UNKNOWN for link in links.values()) else None

    def split(
        self,
        route: RouteRequest,
        decode: Decision,
        prefill: list[EngineKey],
        links: dict[EngineKey, Link] | None,
    ) -> SplitOutcome:
        """Whether moving the prefill off ``decode`` to one of the ``prefill`` engines pays.

        ``links``: each prefill engine's link to ``decode`` (:meth:`links`). With
        topology known, the split is priced over the best link to a prefill engine fast
        enough to pair with, and the outcome carries each such engine's transfer for the
        prefill choice that follows (:class:`Transfers`; None without topology)."""
        cfg = self.disaggregation
        best: Link | None = None
        transfers: Transfers | None = None
        if links is not None:
            uncached = max(route.prompt_tokens - decode.cached_tokens, 0)
            usable = {k: link for k, link in links.items() if link.fast_enough(cfg)}
            best = min(
                (usable or links).values(),
                key=lambda link: link.transfer_s(uncached, cfg),
                default=None,
            )
            transfers = Transfers(
                {
                    key: link.transfer_s(uncached, cfg) / cfg.prefill_s_per_token
                    for key, link in usable.items()
                },
                cfg.prefill_s_per_token,
            )
        decision = decide_split(
            route.prompt_tokens,
            decode.cached_tokens,
            bool(prefill),
            cfg,
            link=best,
            prefill_engines=len(prefill),
        )
        return SplitOutcome(decision, transfers)

    async def prefill(
        self,
        route: RouteRequest,
        model: str,
        exclude: Iterable[str] = (),
        transfers: Transfers | None = None,
    ) -> Decision | None:
        """The prefill engine, by the router's policy; None when none is left.
        ``transfers``: the split's (:attr:`Plan.transfers`); with them, only engines
        whose link to the decode engine is fast enough are candidates, each weighed with
        its transfer."""
        pool = self.candidates(model, ("prefill",), exclude=exclude)
        if transfers is not None:
            pool = transfers.candidates(pool)
            route = transfers.route(route)
        return await self.choose(route, pool) if pool else None

    @staticmethod
    def _explain(split: SplitDecision, prefill: Decision | None) -> str:
        """The link part of the reason: its locality, the transfer it prices, and the
        prefill engine's cost with its transfer term (in blocks, as the policy's)."""
        text = f"link={split.link} transfer={split.transfer_s * 1e3:.2f}ms"
        if prefill is not None:
            chosen = prefill.chosen_terms()
            text += f" prefill={prefill.engine.label}"
            if chosen is not None and prefill.policy == "latency":  # seconds: in ms
                text += (
                    f" prefill_cost={chosen.total * 1e3:.1f}ms"
                    f" prefill_transfer={chosen.transfer * 1e3:.1f}ms"
                )
            elif chosen is not None:
                text += f" prefill_cost={chosen.total:.1f} prefill_transfer={chosen.transfer:.1f}"
        return text

    async def on_load(
        self, request_id: str, block_size: int, subset: Collection[str] | None = None
    ) -> Decision:
        """An engine for a request without a prompt (a GET through a gateway): by load
        alone, among every engine that serves whole requests."""
        seen: dict[EngineKey, None] = {}
        for model in self.pools.models():
            for key in self.candidates(model, SERVING_ROLES, subset=subset):
                seen.setdefault(key)
        if not seen:
            raise NoCandidates("no healthy engine")
        route = RouteRequest(request_id, [], 0, block_size, by_load=True)
        return await self.choose(route, list(seen))
