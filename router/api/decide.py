"""One decision path for every front end: the HTTP API, gRPC Pick and Generate, ext_proc.

:meth:`Decider.prepare` turns a parsed request into its routing facts (the prompt
tokenized with the model's pool tokenizer, its block keys); the choice itself is the
routing core's (:meth:`~router.core.RoutingCore.route`) among candidates the registry
selects. For a model served by prefill and decode pools, the decode engine is chosen
first by its own cost, then :func:`~router.policy.disagg.decide_split` says whether a
prefill engine is worth it, then the prefill engine is chosen by the router's policy.

The HTTP API runs these steps inside its forwarding loop (it retries on another engine
when one fails before the first byte); :meth:`Decider.plan` runs them once for callers
that forward the request themselves (gRPC ``Pick``, Envoy ext_proc). Both call the same
methods on the same policy objects, so the same request, request id and state give the
same engines on every API.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.admission import Overloaded
from router.api.openai import ParsedRequest, tokenize
from router.core import Saturated
from router.hashing import block_keys, seed_for
from router.policy import make_decode_policy
from router.policy.base import Decision, NoCandidates, Policy, RouteRequest
from router.policy.disagg import SplitDecision, decide_split
from router.tokenization import TokenizerUnavailable
from router.types import EngineKey

if TYPE_CHECKING:
    from router.app import RouterApp

log = logging.getLogger("kvroute.decide")

#: Roles of engines that serve a whole request, or its decode leg.
SERVING_ROLES = ("decode", "both")


@dataclass(slots=True)
class Plan:
    """Where one request goes, for a caller that forwards it itself."""

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

    @property
    def mode(self) -> str:
        """``aggregated``, ``local`` (a disaggregated pool served by one engine) or ``split``."""
        if self.split is None:
            return "aggregated"
        return "split" if self.split.split else "local"


def body_text(parsed: ParsedRequest) -> str:
    """The request's prompt text, for estimates when it could not be tokenized."""
    if parsed.messages is not None:
        return " ".join(str(m.get("content") or "") for m in parsed.messages)
    return " ".join(p if isinstance(p, str) else " " * len(p) * 4 for p in parsed.texts or [])


def restrict(candidates: list[EngineKey], subset: Collection[str] | None) -> list[EngineKey]:
    """The candidates whose endpoint (``host:port``) is in ``subset`` (all when None)."""
    if subset is None:
        return candidates
    return [key for key in candidates if key.endpoint in subset]


class Decider:
    """Candidate selection, the policy decision and the disaggregation split."""

    def __init__(self, app: RouterApp) -> None:
        self.app = app
        self.decode_policy: Policy = make_decode_policy(
            app.config.policy, app.config.disaggregation, app.core.policy
        )

    async def prepare(
        self, request_id: str, model: str, parsed: ParsedRequest, session: str | None
    ) -> RouteRequest:
        """Tokenize with the model's pool tokenizer and compute the prompt's block keys.

        Fills ``parsed.prompts``. A tokenizer that cannot be reached leaves the request
        to be routed on load alone rather than failed.
        """
        app = self.app
        base = app.registry.base_of(model)
        tokenizer = app.tokenizers.for_model(base)
        bs = app.block_size_for(base)
        approximate = not tokenizer.exact
        try:
            parsed.prompts = await tokenize(parsed, tokenizer)
            tokens = parsed.routing_prompt
            keys = block_keys(tokens, bs, seed_for(model, parsed.cache_salt))
            prompt_tokens = len(tokens)
        except TokenizerUnavailable as exc:
            log.warning("request %s: tokenizer unavailable (%s)", request_id, exc)
            approximate, keys = True, []
            prompt_tokens = len(body_text(parsed)) // 4
            parsed.prompts = [[0] * prompt_tokens]
        max_tokens = (
            parsed.max_tokens
            if parsed.max_tokens is not None
            else app.config.limits.default_max_tokens
        )
        return RouteRequest(
            request_id,
            keys,
            prompt_tokens,
            bs,
            max_tokens * parsed.n,
            session=session or parsed.user,
            approximate=approximate,
        )

    # ------------------------------------------------------------------ steps

    def candidates(
        self,
        model: str,
        roles: tuple[str, ...] = ("both",),
        exclude: Iterable[str] = (),
        subset: Collection[str] | None = None,
    ) -> list[EngineKey]:
        """Healthy routing targets serving ``model`` in ``roles``, within ``subset``."""
        return restrict(self.app.registry.candidates(model, roles, exclude=exclude), subset)

    async def choose(
        self, route: RouteRequest, candidates: list[EngineKey], policy: Policy | None = None
    ) -> Decision:
        """The policy's choice among ``candidates`` (raises NoCandidates when empty).

        Candidates at ``limits.max_inflight_per_engine`` are skipped; when all are, the
        request waits for room until ``route.wait_until``, then :class:`Overloaded`.
        """
        app = self.app
        while True:
            try:
                return await app.core.route(route, candidates, policy)
            except Saturated as full:
                if route.wait_until is None or not await app.admission.wait_capacity(
                    route.wait_until
                ):
                    app.admission.rejected["engines_full"] += 1
                    raise Overloaded(str(full)) from None

    async def choose_decode(
        self,
        route: RouteRequest,
        model: str,
        exclude: Iterable[str] = (),
        subset: Collection[str] | None = None,
    ) -> Decision:
        """The decode engine of a disaggregated pool, by its own cost."""
        pool = self.candidates(model, SERVING_ROLES, exclude, subset)
        return await self.choose(route, pool, self.decode_policy)

    def split(
        self, route: RouteRequest, model: str, decode: Decision
    ) -> tuple[SplitDecision, list[EngineKey]]:
        """Whether moving the prefill to a prefill engine pays, and the prefill pool."""
        pool = self.candidates(model, ("prefill",))
        split = decide_split(
            route.prompt_tokens, decode.cached_tokens, bool(pool), self.app.config.disaggregation
        )
        self.app.metrics.disagg.labels("split" if split.split else "local", split.reason).inc()
        return split, pool

    # ------------------------------------------------------------------ whole plans

    async def plan(
        self, model: str, route: RouteRequest, load_tokens: int, subset: Collection[str] | None
    ) -> Plan:
        """Every engine a request needs, decided once (raises NoCandidates).

        ``subset`` limits the engine that serves the request (the gateway's destination);
        a split's prefill engine comes from the whole prefill pool.
        """
        if not self.app.registry.is_disaggregated(model):
            decision = await self.choose(route, self.candidates(model, subset=subset))
            return Plan(model, route, decision, load_tokens)
        decode = await self.choose_decode(route, model, subset=subset)
        split, pool = self.split(route, model, decode)
        prefill = await self.choose(route, pool) if split.split else None
        return Plan(model, route, decode, load_tokens, split, prefill)

    async def plan_on_load(self, request_id: str, subset: Collection[str] | None) -> Decision:
        """An engine for a request without a prompt (a GET through a gateway): by load
        alone, among every engine that serves whole requests."""
        seen: dict[EngineKey, None] = {}
        for model in self.app.registry.models():
            for key in self.candidates(model, SERVING_ROLES, subset=subset):
                seen.setdefault(key)
        if not seen:
            raise NoCandidates("no healthy engine")
        route = RouteRequest(request_id, [], 0, self.app.config.block_size)
        return await self.choose(route, list(seen))
