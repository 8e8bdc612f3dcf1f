"""Disaggregated prefill/decode serving: choose the pair, decide the split, hand off.

For a model served by prefill and decode pools, each request:

1. picks a decode engine by its load, with its match depth in view
   (:class:`~router.policy.kv_cost.DecodeCostPolicy`);
2. decides whether a split pays (:func:`~router.policy.disagg.decide_split`); if not,
   the decode engine serves it alone, exactly as in an aggregated pool;
3. otherwise picks a prefill engine by cache affinity and queue (the router's policy)
   and drives the handoff in the pool's dialect (``models[].handoff``, by default
   ``disaggregation.handoff``):

   * **NIXL** (pull): a one-token prefill leg returns ``kv_transfer_params``, then the
     decode leg carries them verbatim and streams the answer. A prefill answer without
     params sends the request to the decode engine as a plain request
     (``prefill_no_params``); a prefill engine that fails or times out is replaced once,
     then the decode engine serves alone unless ``fallback_to_decode`` is off. A decode
     leg that silently recomputed (its usage shows almost nothing cached) is counted.
   * **SGLang** (push): bootstrap fields naming the prefill engine and a random room go
     to both engines at once; the decode engine's answer is relayed, the prefill's
     discarded; if either leg fails before the first byte the other is cancelled. A
     failed prefill leg (or a pair that stalled: the decode leg timed out waiting for
     the prefill's KV) is retried with another prefill engine and a fresh room, both
     legs sent again, then the decode engine serves alone as for NIXL; the decode
     engine is not blamed for it.

A decode engine that fails before the first byte is replaced by another, with a fresh
prefill; after the first byte the stream ends with an SSE error event. The client sees
the prefill leg's ``cached_tokens``. A client that leaves during prefill aborts that
leg (its connection is closed); one that leaves after it leaves the KV pinned on the
prefill engine until the engine's hold timeout, which is counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import msgspec

from router.api.downstream import Downstream
from router.api.errors import ApiError
from router.api.usage import UsageTap
from router.handoff import nixl, sglang
from router.policy.base import Decision, NoCandidates, RouteRequest, request_rng
from router.policy.disagg import SplitDecision
from router.proxy import UpstreamError

if TYPE_CHECKING:
    from router.api.http import HttpApi, Outcome
    from router.api.openai import ParsedRequest

log = logging.getLogger("kvroute.pd")
_encode = msgspec.json.encode
_decode = msgspec.json.decode


class PDForwarder:
    """Serves requests of models whose engines are split into prefill and decode pools."""

    def __init__(self, api: HttpApi) -> None:
        self.api = api
        self.app = api.app

    async def forward(
        self,
        sink: Downstream,
        path: str,
        parsed: ParsedRequest,
        route_request: RouteRequest,
        payload: dict[str, Any],
        body: bytes,
        started: float,
        outcome: Outcome,
    ) -> None:
        app = self.app
        decider = app.decider
        model = parsed.model
        assert model is not None
        failed_decode: set[str] = set()
        last_error: UpstreamError | None = None
        dialect = app.config.handoff_for(app.registry.base_of(model))
        for _attempt in range(1 + app.config.proxy.retries):
            try:
                decode = await decider.choose_decode(route_request, model, exclude=failed_decode)
            except NoCandidates:
                break
            split, _ = decider.split(route_request, model, decode)
            try:
                if not split.split:
                    return await self.api._attempt(
                        sink,
                        path,
                        parsed,
                        route_request,
                        decode,
                        body,
                        started,
                        outcome,
                        extra_headers={"x-kvroute-mode": f"local:{split.reason}"},
                    )
                if dialect == "sglang":
                    return await self._sglang(
                        sink,
                        path,
                        parsed,
                        route_request,
                        payload,
                        body,
                        decode,
                        split,
                        started,
                        outcome,
                    )
                return await self._nixl(
                    sink,
                    path,
                    parsed,
                    route_request,
                    payload,
                    body,
                    decode,
                    split,
                    started,
                    outcome,
                )
            except UpstreamError as err:
                last_error = err
                failed_decode.add(decode.engine.endpoint)
                app.metrics.retries.labels(err.kind).inc()
                log.info(
                    "request %s: decode engine %s failed before the first byte (%s)",
                    route_request.request_id,
                    decode.engine.label,
                    err,
                )
        if last_error is not None:
            raise ApiError(last_error.http_status, f"engine failed: {last_error}")
        raise ApiError(503, f"no healthy decode engine serves model '{model}'", retry_after=1)

    # ------------------------------------------------------------------ NIXL

    async def _nixl(
        self,
        sink: Downstream,
        path: str,
        parsed: ParsedRequest,
        route_request: RouteRequest,
        payload: dict[str, Any],
        body: bytes,
        decode: Decision,
        split: SplitDecision,
        started: float,
        outcome: Outcome,
    ) -> None:
        app = self.app
        cfg = app.config.disaggregation
        model = parsed.model
        assert model is not None
        prefill_bytes = _encode(nixl.prefill_body(payload))
        tried: set[str] = set()
        answer: dict[str, Any] | None = None
        prefill: Decision | None = None
        last: UpstreamError | None = None
        for _ in range(2):  # the chosen prefill engine, then one other
            pool = app.decider.candidates(model, ("prefill",), exclude=tried)
            if not pool:
                break
            prefill = await app.decider.choose(route_request, pool)
            try:
                status, answer = await self._prefill_leg(
                    sink, path, route_request, prefill, prefill_bytes
                )
            except UpstreamError as err:
                tried.add(prefill.engine.endpoint)
                answer, last = None, err
                app.metrics.retries.labels(err.kind).inc()
                log.info(
                    "request %s: prefill engine %s failed (%s)",
                    route_request.request_id,
                    prefill.engine.label,
                    err,
                )
                continue
            if status >= 400:  # the engine refused the request itself: the client's error
                outcome.set("client_error", status)
                headers = {
                    "x-request-id": route_request.request_id,
                    "Content-Type": "application/json",
                }
                return await sink.whole(status, headers, _encode(answer))
            break
        if answer is None:
            return await self._prefill_failed(
                "nixl", last, sink, path, parsed, route_request, decode, body, started, outcome
            )
        assert prefill is not None
        params = nixl.returned_params(answer)
        if params is None:
            app.metrics.handoffs.labels("nixl", "no_params").inc()
            return await self.api._attempt(
                sink,
                path,
                parsed,
                route_request,
                decode,
                body,
                started,
                outcome,
                extra_headers={"x-kvroute-mode": "local:prefill_no_params"},
            )
        prefill_engine = app.registry.engine_of(prefill.engine)
        host = (urlsplit(prefill_engine.url).hostname or "") if prefill_engine else ""
        params, loopback = nixl.check_remote_host(params, host, cfg.rewrite_loopback_host)
        if loopback:
            app.metrics.loopback_hosts.labels(prefill.engine.label).inc()
            log.warning(
                "prefill engine %s reports NIXL remote_host %s, a loopback address a decode "
                "engine elsewhere cannot reach; set VLLM_NIXL_SIDE_CHANNEL_HOST to the pod IP"
                "%s",
                prefill.engine.label,
                params.get("remote_host"),
                "" if cfg.rewrite_loopback_host else " (or disaggregation.rewrite_loopback_host)",
            )
        prefill_cached = nixl.cached_tokens(answer)
        prompt_tokens = route_request.prompt_tokens
        bs = route_request.block_size

        def on_usage(usage: dict[str, Any]) -> None:
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            if nixl.recomputed(cached, prompt_tokens, bs):
                app.metrics.handoffs.labels("nixl", "recomputed").inc()
                log.warning(
                    "request %s: decode engine %s recomputed the prefill instead of "
                    "pulling it from %s",
                    route_request.request_id,
                    decode.engine.label,
                    prefill.engine.label,
                )
            else:
                app.metrics.handoffs.labels("nixl", "pulled").inc()

        tap = UsageTap(on_usage, prefill_cached, drop_usage_event=not parsed.include_usage)
        decode_payload = nixl.decode_body(payload, params)
        if parsed.stream and not parsed.include_usage:
            decode_payload["stream_options"] = {"include_usage": True}  # to see its usage
        app.metrics.transfer_bytes.inc(split.uncached_tokens * cfg.kv_bytes_per_token)
        sent = time.perf_counter()
        try:
            await self.api._attempt(
                sink,
                path,
                parsed,
                route_request,
                decode,
                _encode(decode_payload),
                started,
                outcome,
                cached_tokens=max(prompt_tokens - 1, 0),
                tap=tap,
                extra_headers={
                    "x-kvroute-mode": "split",
                    "x-kvroute-prefill": prefill.engine.label,
                },
            )
        except asyncio.CancelledError:
            if outcome.status == 499:  # the client left before the decode leg answered
                app.metrics.abandoned_tokens.inc(prompt_tokens)
            raise
        app.metrics.decode_leg_first_byte_seconds.observe(time.perf_counter() - sent)

    async def _prefill_leg(
        self,
        sink: Downstream,
        path: str,
        route_request: RouteRequest,
        prefill: Decision,
        body: bytes,
    ) -> tuple[int, dict[str, Any]]:
        """Run a prefill leg to its answer: (status, decoded JSON)."""
        app = self.app
        engine = app.registry.engine_of(prefill.engine)
        assert engine is not None
        ticket = app.core.loads.begin(
            prefill.engine, route_request.prompt_tokens, prefill.cached_tokens, 1
        )
        headers = self.api.upstream_headers(sink, route_request.request_id, engine, prefill.engine)
        url = engine.url + path
        sent = time.perf_counter()
        try:
            try:
                response, deadline = await app.upstream.open(url, body, headers)
            except UpstreamError:
                app.registry.record_failure(engine)
                raise
            try:
                data = await self.api._read_all(response, deadline, engine, url)
            finally:
                app.upstream.finish(response, deadline)
        finally:
            app.core.loads.end(ticket)
        app.metrics.prefill_leg_seconds.observe(time.perf_counter() - sent)
        try:
            answer = _decode(data)
        except msgspec.DecodeError:
            app.registry.record_failure(engine)
            raise UpstreamError("protocol", f"{url} answered a prefill with bad JSON") from None
        if not isinstance(answer, dict):
            raise UpstreamError("protocol", f"{url} answered a prefill with a non-object")
        app.registry.record_success(engine)
        return response.status, answer

    # ------------------------------------------------------------------ SGLang

    async def _sglang(
        self,
        sink: Downstream,
        path: str,
        parsed: ParsedRequest,
        route_request: RouteRequest,
        payload: dict[str, Any],
        body: bytes,
        decode: Decision,
        split: SplitDecision,
        started: float,
        outcome: Outcome,
    ) -> None:
        """Pairs of ``decode`` with the chosen prefill engine, then with one other, each
        with a fresh room; then the decode engine alone (as for NIXL)."""
        app = self.app
        model = parsed.model
        assert model is not None
        tried: set[str] = set()
        last: UpstreamError | None = None
        for _ in range(2):  # the chosen prefill engine, then one other
            pool = app.decider.candidates(model, ("prefill",), exclude=tried)
            if not pool:
                break
            prefill = await app.decider.choose(route_request, pool)
            try:
                return await self._sglang_pair(
                    sink,
                    path,
                    parsed,
                    route_request,
                    payload,
                    decode,
                    prefill,
                    split,
                    started,
                    outcome,
                )
            except _PrefillFailed as failed:
                last = failed.error
                tried.add(prefill.engine.endpoint)
                app.metrics.retries.labels(last.kind).inc()
                log.info(
                    "request %s: SGLang prefill leg on %s failed (%s); decode engine %s not blamed",
                    route_request.request_id,
                    prefill.engine.label,
                    last,
                    decode.engine.label,
                )
        return await self._prefill_failed(
            "sglang", last, sink, path, parsed, route_request, decode, body, started, outcome
        )

    async def _prefill_failed(
        self,
        dialect: str,
        last: UpstreamError | None,
        sink: Downstream,
        path: str,
        parsed: ParsedRequest,
        route_request: RouteRequest,
        decode: Decision,
        body: bytes,
        started: float,
        outcome: Outcome,
    ) -> None:
        """No prefill engine could prefill: the decode engine serves the request alone,
        unless ``disaggregation.fallback_to_decode`` is off (then the last error's status)."""
        self.app.metrics.handoffs.labels(dialect, "prefill_failed").inc()
        if not self.app.config.disaggregation.fallback_to_decode:
            raise ApiError(
                last.http_status if last is not None else 502,
                "no prefill engine could prefill this request",
            )
        return await self.api._attempt(
            sink,
            path,
            parsed,
            route_request,
            decode,
            body,
            started,
            outcome,
            extra_headers={"x-kvroute-mode": "local:prefill_failed"},
        )

    async def _sglang_pair(
        self,
        sink: Downstream,
        path: str,
        parsed: ParsedRequest,
        route_request: RouteRequest,
        payload: dict[str, Any],
        decode: Decision,
        prefill: Decision,
        split: SplitDecision,
        started: float,
        outcome: Outcome,
    ) -> None:
        """Both legs of one pair at once; when one fails, the other is cancelled.

        Raises :class:`_PrefillFailed` when the prefill leg failed (the decode engine is
        not to blame; the caller tries another prefill engine), and UpstreamError when
        the decode leg failed before its first byte (the caller tries another decode
        engine). A decode leg that times out while the prefill leg has not answered
        either counts as the prefill's failure: a decode engine cannot answer before the
        prefill engine pushes the KV. Once the decode leg has begun answering the client,
        a failing prefill leg no longer stops it (the KV has arrived).
        """
        app = self.app
        prefill_engine = app.registry.engine_of(prefill.engine)
        assert prefill_engine is not None
        port = prefill_engine.bootstrap_port
        if port is None:
            raise _PrefillFailed(
                UpstreamError("protocol", f"{prefill_engine.url} has no bootstrap port")
            )
        host = urlsplit(prefill_engine.url).hostname or ""
        # a fresh room for every pair a request tries
        pair = f"{route_request.request_id}\x00{prefill.engine.label}\x00{decode.engine.label}"
        room = sglang.new_room(request_rng(pair))
        leg_body = _encode(sglang.with_bootstrap(payload, host, port, room))
        watched = _Watched(sink)
        prefill_task = asyncio.ensure_future(
            self._prefill_leg(
                sink,
                path,
                route_request,
                prefill,
                _encode(sglang.with_bootstrap(_prefill_only(payload), host, port, room)),
            )
        )
        decode_task = asyncio.ensure_future(
            self.api._attempt(
                watched,
                path,
                parsed,
                route_request,
                decode,
                leg_body,
                started,
                outcome,
                cached_tokens=max(route_request.prompt_tokens - 1, 0),
                extra_headers={
                    "x-kvroute-mode": "split",
                    "x-kvroute-prefill": prefill.engine.label,
                },
            )
        )
        tasks = (prefill_task, decode_task)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if prefill_task.done() and not watched.answered:
                error = prefill_task.exception()
                if error is not None:  # the pair cannot complete: stop the decode leg
                    await _cancel(decode_task)
                    raise _PrefillFailed(error) if isinstance(error, UpstreamError) else error
                status, answer = prefill_task.result()
                if status >= 400:  # the engine refused the request: the client's error
                    await _cancel(decode_task)
                    outcome.set("client_error", status)
                    headers = {
                        "x-request-id": route_request.request_id,
                        "Content-Type": "application/json",
                    }
                    return await sink.whole(status, headers, _encode(answer))
            elif decode_task.done() and not prefill_task.done():
                error = decode_task.exception()
                if isinstance(error, UpstreamError) and error.kind == "timeout":
                    await _cancel(prefill_task)
                    raise _PrefillFailed(error)
            await decode_task
        except BaseException:
            for task in tasks:
                await _cancel(task)
            raise
        if outcome.outcome != "client_error":
            app.metrics.handoffs.labels("sglang", "pulled").inc()
            app.metrics.transfer_bytes.inc(
                split.uncached_tokens * app.config.disaggregation.kv_bytes_per_token
            )
        await asyncio.gather(prefill_task, return_exceptions=True)  # its answer is discarded


class _PrefillFailed(Exception):
    """An SGLang pair failed on its prefill leg (``error`` says how)."""

    def __init__(self, error: UpstreamError) -> None:
        super().__init__(str(error))
        self.error = error


class _Watched:
    """A :class:`Downstream` that remembers whether anything reached the client."""

    __slots__ = ("answered", "sink")

    def __init__(self, sink: Downstream) -> None:
        self.sink = sink
        self.answered = False

    @property
    def headers(self) -> Any:
        return self.sink.headers

    async def whole(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.answered = True
        await self.sink.whole(status, headers, body)

    async def begin(self, status: int, headers: dict[str, str]) -> None:
        self.answered = True
        await self.sink.begin(status, headers)

    async def write(self, chunk: bytes) -> None:
        await self.sink.write(chunk)

    async def end(self) -> None:
        await self.sink.end()


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` if it still runs and wait until it has stopped."""
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _prefill_only(payload: dict[str, Any]) -> dict[str, Any]:
    """An SGLang prefill leg needs no stream: its answer is discarded."""
    body = dict(payload)
    body["stream"] = False
    body.pop("stream_options", None)
    return body
