"""Disaggregated prefill/decode serving over HTTP: plan, then hand off in the dialect.

For a model served by prefill and decode pools, each request is planned by the
:class:`~router.plan.Planner` (the decode engine by its own cost, the split decision,
the prefill engine by the router's policy). A plan that does not split is served by
the decode engine alone, exactly as in an aggregated pool (``x-kvroute-mode:
local:REASON``); a split goes to the plan's handoff dialect
(:mod:`router.handoff.registry`: ``models[].handoff``, by default
``disaggregation.handoff``), which runs its legs through this module's
:class:`PDForwarder` (the :class:`~router.handoff.base.Legs` protocol).

A decode engine that fails before the first byte is replaced: the request is planned
again without it, with a fresh prefill (unless it timed out after accepting the
request: 504, as in an aggregated pool); after the first byte the stream ends with an
SSE error event. A client that leaves during prefill aborts that leg (its connection
is closed); one that leaves after it leaves the KV pinned on the prefill engine until
the engine's hold timeout, which is counted.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec

from router.handoff import registry as dialects
from router.policy.base import Decision
from router.proxy import UpstreamError
from router.serving.charges import prefill_charge

if TYPE_CHECKING:
    from router.config import DisaggregationConfig
    from router.fleet.registry import Engine
    from router.plan import Plan
    from router.serving.context import RequestContext
    from router.serving.downstream import Downstream
    from router.serving.forward import Forwarder
    from router.serving.usage import UsageTap
    from router.types import EngineKey

_encode = msgspec.json.encode
_decode = msgspec.json.decode


class PDForwarder:
    """Serves requests of models whose engines are split into prefill and decode pools;
    the :class:`~router.handoff.base.Legs` every dialect runs on."""

    def __init__(self, forwarder: Forwarder) -> None:
        self.forwarder = forwarder
        self.app = forwarder.app
        self.metrics = forwarder.app.metrics
        self.loads = forwarder.app.core.loads

    @property
    def disaggregation(self) -> DisaggregationConfig:
        return self.app.config.disaggregation

    @property
    def engine_cidrs(self) -> list[str]:
        return self.app.config.auth.engine_cidrs

    async def forward(self, ctx: RequestContext) -> None:
        """Serve a request by its plan: the decode engine alone, or split in the plan's
        dialect; planned again without a decode engine that failed before the first
        byte."""
        planner = self.app.decider.planner

        async def plan(exclude: set[str]) -> Plan:
            return await planner.plan(ctx.model, ctx.request, ctx.load_tokens, ctx.subset, exclude)

        async def serve(plan: Plan) -> None:
            if plan.prefill is None or plan.dialect is None:
                return await self.local(ctx, plan.decode, plan.reason)
            return await dialects.get(plan.dialect).serve(ctx, plan, self)

        await self.forwarder.with_retries(
            ctx, plan, serve, lambda plan: plan.decode, role="decode", count_last_failure=True
        )

    # ------------------------------------------------------------------ Legs

    def engine(self, key: EngineKey) -> Engine | None:
        return self.app.registry.engine_of(key)

    async def another_prefill(
        self, ctx: RequestContext, plan: Plan, exclude: set[str]
    ) -> Decision | None:
        planner = self.app.decider.planner
        return await planner.prefill(ctx.request, ctx.model, exclude, plan.transfers)

    async def local(self, ctx: RequestContext, decode: Decision, reason: str) -> None:
        await self.forwarder.attempt(ctx, decode, headers={"x-kvroute-mode": f"local:{reason}"})

    async def refused(self, ctx: RequestContext, status: int, answer: dict[str, Any]) -> None:
        ctx.outcome.set("client_error", status)
        headers = {"x-request-id": ctx.request_id, "Content-Type": "application/json"}
        await ctx.sink.whole(status, headers, _encode(answer))

    async def decode_leg(
        self,
        ctx: RequestContext,
        decode: Decision,
        body: bytes,
        *,
        sink: Downstream | None = None,
        cached_tokens: int | None = None,
        tap: UsageTap | None = None,
        headers: dict[str, str] | None = None,
        upstream_headers: dict[str, str] | None = None,
    ) -> None:
        await self.forwarder.attempt(
            ctx,
            decode,
            body,
            sink=sink,
            cached_tokens=cached_tokens,
            tap=tap,
            headers=headers,
            upstream_headers=upstream_headers,
        )

    async def prefill_leg(
        self, ctx: RequestContext, prefill: Decision, body: bytes
    ) -> tuple[int, dict[str, Any]]:
        """Run a prefill leg to its answer: (status, decoded JSON)."""
        app = self.app
        engine = app.registry.engine_of(prefill.engine)
        assert engine is not None
        ticket = prefill_charge(ctx.request, prefill).begin(self.loads)
        headers = self.forwarder.upstream_headers(
            ctx.sink.headers, ctx.request_id, engine, prefill.engine, ctx.path
        )
        url = engine.url + ctx.path
        sent = time.perf_counter()
        with await self.forwarder.open(engine, url, body, headers, ticket) as call:
            data = await call.read()
        self.metrics.prefill_leg_seconds.observe(time.perf_counter() - sent)
        try:
            answer = _decode(data)
        except msgspec.DecodeError:
            call.failed()
            raise UpstreamError("protocol", f"{url} answered a prefill with bad JSON") from None
        if not isinstance(answer, dict):
            raise UpstreamError("protocol", f"{url} answered a prefill with a non-object")
        call.succeeded()
        return call.status, answer
