"""The router's side of the request plan: tokenization and the admission wait.

:meth:`Decider.prepare` turns a parsed request into its routing facts (the prompt
tokenized with the model's pool tokenizer, its block keys). Every choice of engines is
the :class:`~router.plan.Planner`'s, :attr:`Decider.planner`, wired from the router's
registry, routing core and configuration as the simulator's is
(:func:`~router.serving.planning.wire_planner`); when every candidate engine is full
the planner waits here (:meth:`Decider.wait_for_room`: ``limits`` and the admission
queue), then refuses with 429. HTTP, gRPC ``Pick`` and ``Generate`` and ext_proc all
plan through it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from router.admission import Overloaded
from router.core import Saturated
from router.flow.isolation import Yielding
from router.hashing import block_keys, seed_for
from router.media import block_extra_keys
from router.plan import Plan, Planner
from router.policy.base import Decision, Policy, RouteRequest
from router.policy.disagg import SplitDecision
from router.policy.latency_config import MIN_SLO_MS
from router.serving.errors import ApiError
from router.serving.headers import SLO_TPOT_HEADER, SLO_TTFT_HEADER, header
from router.serving.parsing import ParsedRequest, tokenize
from router.serving.planning import wire_planner
from router.tokenization import TokenizerUnavailable

if TYPE_CHECKING:
    from collections.abc import Callable

    from router.admission import Admission
    from router.core import RoutingCore
    from router.fleet.registry import Registry
    from router.live_config import LiveConfig
    from router.metrics import RouterMetrics
    from router.tokenization import Tokenizers

log = logging.getLogger("kvroute.decide")


def body_text(parsed: ParsedRequest) -> str:
    """The request's prompt text, for estimates when it could not be tokenized."""
    if parsed.messages is not None:
        return " ".join(str(m.get("content") or "") for m in parsed.messages)
    return " ".join(p if isinstance(p, str) else " " * len(p) * 4 for p in parsed.texts or [])


def slo_ms(name: str, value: str) -> float:
    """An SLO header's milliseconds: from :data:`MIN_SLO_MS` to a day, else 400."""
    try:
        ms = float(value.strip())
    except ValueError:
        ms = math.nan
    if not (MIN_SLO_MS <= ms <= 86_400_000):
        raise ApiError(
            400,
            f"header {name} must be a number of milliseconds from {MIN_SLO_MS} to 86400000",
            param=name,
        )
    return ms


class Decider:
    """Tokenization and the admission wait around the router's :class:`Planner`."""

    def __init__(
        self,
        live: LiveConfig,
        registry: Registry,
        core: RoutingCore,
        tokenizers: Tokenizers,
        admission: Admission,
        metrics: RouterMetrics,
        block_size_for: Callable[[str], int],
    ) -> None:
        self.live = live
        self.registry = registry
        self.core = core
        self.tokenizers = tokenizers
        self.admission = admission
        self.metrics = metrics
        self.block_size_for = block_size_for
        self.reconfigure()

    def reconfigure(self) -> None:
        """Build the decode policy and the planner from the configuration in force (and
        the routing core's policy): at start, and when a reload changes ``policy`` or
        ``disaggregation``."""
        config = self.live.current
        registry = self.registry
        self.planner: Planner = wire_planner(
            registry,
            self.core,
            config.policy,
            config.disaggregation,
            lambda model: self.live.current.handoff_for(registry.base_of(model)),
            wait=self.wait_for_room,
            on_split=self._count_split,
            locate=registry.topology_of,
        )
        self.decode_policy: Policy = self.planner.decode_policy

    def session_of(self, headers: Mapping[str, str]) -> str | None:
        """The session key in the configured header (``policy.session_header``)."""
        return header(headers, self.live.current.policy.session_header)

    def objectives(self, route: RouteRequest, model: str, headers: Mapping[str, str]) -> None:
        """Set ``route``'s SLOs: headers ``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` (llm-d's
        names; a positive number of milliseconds, else 400), or the model's defaults
        (``policy.latency.slo``)."""
        default = self.live.current.policy.latency.slo_for(self.registry.base_of(model))
        for name, attr, fallback in (
            (SLO_TTFT_HEADER, "slo_ttft_s", default.ttft_ms if default else None),
            (SLO_TPOT_HEADER, "slo_tpot_s", default.tpot_ms if default else None),
        ):
            value = header(headers, name)
            ms = fallback if value is None else slo_ms(name, value)
            setattr(route, attr, None if ms is None else ms / 1e3)

    async def prepare(
        self,
        request_id: str,
        model: str,
        parsed: ParsedRequest,
        session: str | None,
        headers: Mapping[str, str] | None = None,
    ) -> RouteRequest:
        """Tokenize with the model's pool tokenizer and compute the prompt's block keys.

        Fills ``parsed.prompts``. A tokenizer that cannot be reached leaves the request
        to be routed on load alone rather than failed.
        """
        base = self.registry.base_of(model)
        tokenizer = self.tokenizers.for_model(base)
        bs = self.block_size_for(base)
        approximate = not tokenizer.exact
        try:
            parsed.prompts = await tokenize(parsed, tokenizer)
            tokens = parsed.routing_prompt
            extra = block_extra_keys(parsed.media, bs) if parsed.media else None
            keys = block_keys(tokens, bs, seed_for(model, parsed.cache_salt), extra=extra)
            prompt_tokens = len(tokens)
        except TokenizerUnavailable as exc:
            log.warning("request %s: tokenizer unavailable (%s)", request_id, exc)
            approximate, keys = True, []
            prompt_tokens = len(body_text(parsed)) // 4
            parsed.prompts = [[0] * prompt_tokens]
        output = parsed.output_tokens
        max_tokens = output if output is not None else self.live.current.limits.default_max_tokens
        route = RouteRequest(
            request_id,
            keys,
            prompt_tokens,
            bs,
            max_tokens * parsed.n * len(parsed.prompts),  # every sequence may run to the end
            session=session or parsed.user,
            approximate=approximate,
        )
        self.objectives(route, model, headers or {})
        return route

    async def wait_for_room(self, route: RouteRequest, full: Saturated) -> None:
        """Every candidate is at ``limits.max_inflight_per_engine``: wait for room until
        ``route.wait_until``, then :class:`Overloaded`. Every candidate prefilling an
        outranking request (:class:`Yielding`): wait for one to end, then try again."""
        admission = self.admission
        if isinstance(full, Yielding):
            # Wait for an outranking prefill to end, then try again (the isolation ends
            # the yielding when its wait is over); a wait that cannot start ends it now.
            if not await admission.wait_capacity(full.until):
                now = admission.clock()
                isolation = self.core.isolation
                if now < full.until and route.flow is not None and isolation is not None:
                    isolation.stop_waiting(route.flow, now)
            return
        if route.wait_until is None or not await admission.wait_capacity(route.wait_until):
            admission.rejected["engines_full"] += 1
            raise Overloaded(str(full)) from None

    def _count_split(self, split: SplitDecision) -> None:
        self.metrics.disagg.labels("split" if split.split else "local", split.reason).inc()
        if split.split:
            self.metrics.disagg_links.labels(split.link or "unknown").inc()

    # ------------------------------------------------------------------ whole plans

    async def plan(
        self, model: str, route: RouteRequest, load_tokens: int, subset: Collection[str] | None
    ) -> Plan:
        """Every engine a request needs (:meth:`Planner.plan`; raises NoCandidates)."""
        return await self.planner.plan(model, route, load_tokens, subset)

    async def plan_on_load(self, request_id: str, subset: Collection[str] | None) -> Decision:
        """An engine for a request without a prompt, by load alone (:meth:`Planner.on_load`)."""
        return await self.planner.on_load(request_id, self.live.current.block_size, subset)
