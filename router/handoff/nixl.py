"""vLLM's NixlConnector dialect (pull): build both legs, read what the prefill returns.

* Prefill leg: the client's body with ``stream: false``, ``max_tokens: 1`` (and
  ``max_completion_tokens: 1`` if present), ``stream_options`` and ``min_tokens``
  removed, and ``kv_transfer_params`` asking for a remote decode. Same ``X-Request-Id``.
* The prefill answer carries ``kv_transfer_params`` (``do_remote_prefill``,
  ``remote_engine_id``, ``remote_block_ids``, ``remote_request_id``, ``remote_host``,
  ``remote_port``, ``tp_size``, ...) only when it finished length-capped. They are
  opaque: every field goes to the decode leg verbatim.
* Decode leg: the client's body (streaming as the client asked) plus those params.

``remote_host``/``remote_port`` name the prefill engine's NIXL side channel, not its
HTTP port; a loopback host is unreachable from another machine whatever a proxy
writes, so it is warned about and rewritten only when configured (never the port).

:class:`NixlHandoff` drives both legs for the router. A prefill answer without params
sends the request to the decode engine as a plain request (``prefill_no_params``), and
so does one naming a side channel off the prefill engine's host and outside
``auth.engine_cidrs`` (``side_channel_refused``); a prefill engine that fails or times
out is replaced once, then the decode engine serves alone unless ``fallback_to_decode``
is off. A decode leg that silently recomputed (its usage shows almost nothing cached)
is counted.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import msgspec

from router.handoff.base import PREFILL_TRIES, Directions, Handoff, Legs, prefill_saved
from router.proxy import UpstreamError
from router.security import host_allowed
from router.serving.charges import Charges
from router.serving.usage import UsageTap

if TYPE_CHECKING:
    from router.fleet.registry import Engine
    from router.plan import Plan
    from router.policy.base import Decision
    from router.serving.context import RequestContext

log = logging.getLogger("kvroute.pd")
_encode = msgspec.json.encode

REMOTE_DECODE_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(payload: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: one token, not streamed, asking for a remote decode."""
    body = dict(payload)
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body.pop("stream_options", None)
    body.pop("min_tokens", None)
    body["kv_transfer_params"] = dict(REMOTE_DECODE_PARAMS)
    return body


def returned_params(answer: Mapping[str, Any]) -> dict[str, Any] | None:
    """The params a prefill answer hands to the decode leg, if it gave usable ones."""
    params = answer.get("kv_transfer_params")
    if isinstance(params, dict) and params.get("do_remote_prefill"):
        return params
    return None


def decode_body(payload: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The decode leg's body: the client's request plus the params, copied verbatim."""
    body = dict(payload)
    body["kv_transfer_params"] = dict(params)
    return body


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_remote_host(
    params: dict[str, Any], engine_host: str, rewrite: bool
) -> tuple[dict[str, Any], bool]:
    """Flag (and optionally fix) a loopback ``remote_host`` from a non-loopback engine.

    Returns the params (rewritten only when ``rewrite``) and whether they needed it.
    """
    host = params.get("remote_host")
    if not isinstance(host, str) or not is_loopback(host) or is_loopback(engine_host):
        return params, False
    if rewrite:
        params = {**params, "remote_host": engine_host}
    return params, True


def usage_is_echoed(params: Mapping[str, Any]) -> bool:
    """Whether the decode leg's ``cached_tokens`` will only echo the prefill's.

    vLLM 0.32 returns ``remote_prefill_cached_tokens`` (the prefill engine's own cache
    hits) and reports it as the decode leg's ``cached_tokens``, pulled or recomputed
    alike: then the decode leg's usage cannot tell whether the KV was pulled.
    """
    return "remote_prefill_cached_tokens" in params


def recomputed(decode_cached: int | None, prompt_tokens: int, block_size: int) -> bool:
    """Whether a decode leg prefilled locally instead of using the pulled KV.

    A pulled prompt counts as cached except its last token; vLLM (and the emulator) log
    a failed pull and recompute, which shows as a decode leg with (almost) nothing
    cached. One block of slack covers how engines round.
    """
    return decode_cached is not None and decode_cached < prompt_tokens - block_size - 1


async def side_channel_refused(
    params: Mapping[str, Any], engine_host: str, cidrs: list[str]
) -> str | None:
    """Why a decode engine may not be sent to the side channel a prefill answer names
    (its host must be the prefill engine's own or lie in ``auth.engine_cidrs``), or None."""
    host = params.get("remote_host")
    if host is None or host == engine_host:
        return None
    if not isinstance(host, str) or not host:
        return f"remote_host {host!r} is not a host"
    return await host_allowed(host, cidrs)


class NixlHandoff(Handoff):
    """Pull: a one-token prefill leg, then the decode leg with its ``kv_transfer_params``."""

    name = "nixl"

    def directions(self, plan: Plan, prefill: Engine | None) -> Directions:
        out = super().directions(plan, prefill)
        out.pick["prefill_kv_transfer_params_json"] = _encode(REMOTE_DECODE_PARAMS).decode()
        return out

    async def serve(self, ctx: RequestContext, plan: Plan, legs: Legs) -> None:
        body = _encode(prefill_body(ctx.payload))
        tried: set[str] = set()
        answer: dict[str, Any] | None = None
        prefill: Decision | None = None
        last: UpstreamError | None = None
        for attempt in range(PREFILL_TRIES):  # the planned prefill engine, then one other
            prefill = plan.prefill if attempt == 0 else await legs.another_prefill(ctx, plan, tried)
            if prefill is None:
                break
            try:
                status, answer = await legs.prefill_leg(ctx, prefill, body)
            except UpstreamError as err:
                tried.add(prefill.engine.endpoint)
                answer, last = None, err
                legs.metrics.retries.labels(err.kind).inc()
                log.info(
                    "request %s: prefill engine %s failed (%s)",
                    ctx.request_id,
                    prefill.engine.label,
                    err,
                )
                continue
            if status >= 400:  # the engine refused the request itself: the client's error
                return await legs.refused(ctx, status, answer)
            break
        if answer is None or prefill is None:
            return await self.fall_back(ctx, plan, legs, last)
        params = returned_params(answer)
        if params is None:
            legs.metrics.handoffs.labels("nixl", "no_params").inc()
            return await legs.local(ctx, plan.decode, "prefill_no_params")
        params = await self._checked(ctx, legs, prefill, params)
        if params is None:
            return await legs.local(ctx, plan.decode, "side_channel_refused")
        await self._decode(ctx, plan, legs, prefill, answer, params)

    async def _checked(
        self, ctx: RequestContext, legs: Legs, prefill: Decision, params: dict[str, Any]
    ) -> dict[str, Any] | None:
        """The params with a loopback side channel flagged (and rewritten when
        configured); None when the decode engine may not be sent to it."""
        cfg = legs.disaggregation
        engine = legs.engine(prefill.engine)
        host = (urlsplit(engine.url).hostname or "") if engine is not None else ""
        params, loopback = check_remote_host(params, host, cfg.rewrite_loopback_host)
        if loopback:
            legs.metrics.loopback_hosts.labels(prefill.engine.label).inc()
            log.warning(
                "prefill engine %s reports NIXL remote_host %s, a loopback address a decode "
                "engine elsewhere cannot reach; set VLLM_NIXL_SIDE_CHANNEL_HOST to the pod IP"
                "%s",
                prefill.engine.label,
                params.get("remote_host"),
                "" if cfg.rewrite_loopback_host else " (or disaggregation.rewrite_loopback_host)",
            )
        refused = await side_channel_refused(params, host, legs.engine_cidrs)
        if refused is None:
            return params
        legs.metrics.handoffs.labels("nixl", "side_channel_refused").inc()
        log.warning(
            "request %s: prefill engine %s names a NIXL side channel the decode engine "
            "may not be sent to (%s); decoding without the handoff",
            ctx.request_id,
            prefill.engine.label,
            refused,
        )
        return None

    async def _decode(
        self,
        ctx: RequestContext,
        plan: Plan,
        legs: Legs,
        prefill: Decision,
        answer: dict[str, Any],
        params: dict[str, Any],
    ) -> None:
        """The decode leg, carrying ``params``; its usage tells whether it pulled."""
        metrics, parsed = legs.metrics, ctx.parsed
        prompt_tokens = ctx.request.prompt_tokens
        bs = ctx.request.block_size
        echoed = usage_is_echoed(params)

        def on_usage(usage: dict[str, Any]) -> None:
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            if echoed:  # vLLM >= 0.32: see usage_is_echoed
                metrics.handoffs.labels("nixl", "unverified").inc()
            elif recomputed(cached, prompt_tokens, bs):
                metrics.handoffs.labels("nixl", "recomputed").inc()
                log.warning(
                    "request %s: decode engine %s recomputed the prefill instead of "
                    "pulling it from %s",
                    ctx.request_id,
                    plan.decode.engine.label,
                    prefill.engine.label,
                )
            else:
                metrics.handoffs.labels("nixl", "pulled").inc()

        tap = UsageTap(
            on_usage, prefill_saved(answer, prefill), drop_usage_event=not parsed.include_usage
        )
        payload = decode_body(ctx.payload, params)
        if parsed.stream and not parsed.include_usage:
            payload["stream_options"] = {"include_usage": True}  # to see its usage
        assert plan.split is not None
        metrics.transfer_bytes.inc(
            plan.split.uncached_tokens * legs.disaggregation.kv_bytes_per_token
        )
        sent = time.perf_counter()
        try:
            await legs.decode_leg(
                ctx,
                plan.decode,
                _encode(payload),
                cached_tokens=Charges.of(plan).decode.cached_tokens,
                tap=tap,
                headers={"x-kvroute-mode": "split", "x-kvroute-prefill": prefill.engine.label},
            )
        except asyncio.CancelledError:
            if ctx.outcome.status == 499:  # the client left before the decode leg answered
                metrics.abandoned_tokens.inc(prompt_tokens)
            raise
        metrics.decode_leg_first_byte_seconds.observe(time.perf_counter() - sent)
