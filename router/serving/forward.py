"""A prepared request on its way to its engines: the engine call and its retries.

:class:`EngineCall` is one request to one engine, from opening it to the end of its load
ticket: the engine's health is told what the call showed (:class:`EngineHealth`), and
the answer is read whole (:func:`~router.serving.relay.read_all`) or relayed
(:func:`~router.serving.relay.relay`). Every caller that talks to an engine for a
client goes through it: a generation (:meth:`Forwarder.attempt`), a split's prefill
leg (:mod:`router.serving.split`), an engine route passed through (:meth:`Forwarder.by_load`),
``count_tokens`` and the sidecar (which has no ticket and reports no health).

:class:`Forwarder` is what the front ends that forward (HTTP, gRPC ``Generate``) share:
a prepared generation served by its plan (:meth:`Forwarder.forward`: an aggregated
pool's engine, or a split's handoff), an engine route's request by load, and the one
retry rule of them all (:meth:`Forwarder.with_retries`: a failure before the first byte
is tried again elsewhere, an engine that accepted the request and went quiet is a 504);
with the headers every request to an engine carries (``X-Request-Id``, the DP rank, the
client's credentials), the load charge of a generation's try, its relay, and the
tokenizer check against the engine's ``usage``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, cast

import msgspec

from router.http1 import HTTPError
from router.plan import SERVING_ROLES
from router.policy.base import NoCandidates
from router.proxy import UpstreamError
from router.serving.errors import ApiError, shape_for
from router.serving.relay import SSE_HEADERS, RelayHooks, first_chunk, read_all, relay
from router.serving.usage import engine_input_tokens, stream_input_tokens

if TYPE_CHECKING:
    from router.fleet.load import LoadTracker, Ticket
    from router.fleet.registry import Engine, Registry
    from router.http1 import Response
    from router.policy.base import Decision, RouteRequest
    from router.proxy import Deadline, Upstream
    from router.serving.context import AnswerWatch, Outcome, RequestContext
    from router.serving.downstream import Downstream
    from router.serving.parsing import ParsedRequest
    from router.serving.relay import Health
    from router.serving.services import Services
    from router.serving.usage import UsageTap
    from router.types import EngineKey

log = logging.getLogger("kvroute.http")
T = TypeVar("T")

_JSON = "application/json"
_CHAT, _COMPLETIONS, _MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"
_TIMED_PATHS = frozenset((_CHAT, _COMPLETIONS, _MESSAGES))
"""Paths whose streamed answer's first event comes with the first token (vLLM's)."""


class EngineHealth:
    """An engine's :class:`~router.serving.relay.Health`: the registry's failures and
    successes of it."""

    __slots__ = ("engine", "registry")

    def __init__(self, registry: Registry, engine: Engine) -> None:
        self.registry = registry
        self.engine = engine

    def failed(self) -> None:
        self.registry.record_failure(self.engine)

    def succeeded(self) -> None:
        self.registry.record_success(self.engine)


class EngineCall:
    """One request to one engine, open: its answer's head has arrived.

    :meth:`open` sends it; the call is then a context manager whose exit finishes the
    exchange (the connection is reused if the answer was read to its end) and ends the
    load ticket, if it has one. ``health`` is told of every failure the call sees
    (:meth:`succeeded` and :meth:`failed` tell it the rest).
    """

    __slots__ = ("deadline", "health", "loads", "response", "ticket", "upstream", "url")

    def __init__(
        self,
        upstream: Upstream,
        url: str,
        response: Response,
        deadline: Deadline,
        health: Health | None,
        loads: LoadTracker | None,
        ticket: Ticket | None,
    ) -> None:
        self.upstream = upstream
        self.url = url
        self.response = response
        self.deadline = deadline
        self.health = health
        self.loads = loads
        self.ticket = ticket

    @classmethod
    async def open(
        cls,
        upstream: Upstream,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        health: Health | None = None,
        loads: LoadTracker | None = None,
        ticket: Ticket | None = None,
    ) -> EngineCall:
        """POST ``body`` to ``url``. Raises :class:`UpstreamError` (the ticket ended, an
        engine fault told to ``health``) when it cannot be reached, times out, or answers
        5xx or 429."""
        try:
            response, deadline = await upstream.open(url, body, headers)
        except UpstreamError as err:
            if loads is not None and ticket is not None:
                loads.end(ticket)
            if err.engine_fault and health is not None:
                health.failed()
            raise
        except BaseException:
            if loads is not None and ticket is not None:
                loads.end(ticket)
            raise
        return cls(upstream, url, response, deadline, health, loads, ticket)

    def __enter__(self) -> EngineCall:
        return self

    def __exit__(self, *exc: object) -> None:
        self.upstream.finish(self.response, self.deadline)
        self.done()

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def content_type(self) -> str:
        return self.response.headers.get("content-type", _JSON)

    def done(self) -> None:
        """The engine is done with the request: its ticket ends (once)."""
        if self.loads is not None and self.ticket is not None:
            self.loads.end(self.ticket)

    def succeeded(self) -> None:
        if self.health is not None:
            self.health.succeeded()

    def failed(self) -> None:
        if self.health is not None:
            self.health.failed()

    async def read(self) -> bytes:
        """The whole answer (:class:`UpstreamError` if it breaks). The engine is done
        with a request once its answer is read: the ticket ends here, before the client
        has the last byte, or a client that sends its next turn at once could find this
        one still counted on the engine."""
        data = await read_all(self.upstream, self.response, self.deadline, self.url, self.health)
        self.done()
        return data

    async def first_chunk(self) -> bytes:
        """The first bytes of an event stream (:func:`~router.serving.relay.first_chunk`)."""
        return await first_chunk(self.response, self.deadline, self.health)

    async def relay(
        self,
        sink: Downstream,
        head: dict[str, str],
        hooks: RelayHooks,
        idle_timeout_s: float,
        *,
        first: bytes | None = None,
        tap: UsageTap | None = None,
        watch: AnswerWatch | None = None,
    ) -> bytes | None:
        """Relay the answer's event stream into ``sink``
        (:func:`~router.serving.relay.relay`)."""
        return await relay(
            self.upstream.deadlines,
            self.response,
            self.deadline,
            idle_timeout_s,
            sink,
            head,
            hooks,
            first=first,
            tap=tap,
            watch=watch,
        )


class Forwarder:
    """What the front ends that forward a request share of talking to its engines."""

    def __init__(self, app: Services) -> None:
        from router.serving.split import PDForwarder

        self.app = app
        self.split = PDForwarder(self)
        """Serves the models whose engines are split into prefill and decode pools."""

    async def forward(self, ctx: RequestContext) -> None:
        """Serve a prepared generation into ``ctx.sink``: by its plan's handoff for
        prefill and decode pools (:mod:`router.serving.split`), else on the planned engine;
        either retried elsewhere before the first byte (:meth:`with_retries`). Raises
        :class:`ApiError` while nothing has reached the sink."""
        if self.app.registry.is_disaggregated(ctx.model):
            await self.split.forward(ctx)
        else:
            await self.aggregated(ctx)

    async def aggregated(self, ctx: RequestContext) -> None:
        """An aggregated pool: the planned engine, then (on a failure before the first
        byte) the plan again without the engines that failed."""
        planner = self.app.decider.planner
        route_request = ctx.request

        async def choose(exclude: set[str]) -> Decision:
            plan = await planner.plan(
                ctx.model, route_request, ctx.load_tokens, ctx.subset, exclude
            )
            decision = plan.decode
            if not exclude:  # the first choice
                self._routed(ctx)
                if route_request.prompt_tokens:
                    self.app.metrics.prefix_match.observe(
                        decision.cached_tokens / route_request.prompt_tokens
                    )
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("request %s: %s", route_request.request_id, decision.describe())
            return decision

        await self.with_retries(ctx, choose, lambda decision: self.attempt(ctx, decision))

    async def by_load(self, ctx: RequestContext) -> None:
        """An engine route's request (nothing tokenized): an engine serving its model by
        the policy on load alone, then (on a failure before the first byte) another; the
        engine's answer goes to the client as it is."""
        planner = self.app.decider.planner

        async def choose(exclude: set[str]) -> Decision:
            candidates = planner.candidates(ctx.model, SERVING_ROLES, exclude)
            decision = await planner.choose(ctx.request, candidates)
            if not exclude:  # the first choice
                self._routed(ctx)
            return decision

        await self.with_retries(ctx, choose, lambda decision: self._as_is(ctx, decision))

    def _routed(self, ctx: RequestContext) -> None:
        """The first engine is chosen: the router's part of the request is done."""
        self.app.metrics.routing_seconds.observe(time.perf_counter() - ctx.started)

    async def with_retries(
        self,
        ctx: RequestContext,
        choose: Callable[[set[str]], Awaitable[T]],
        attempt: Callable[[T], Awaitable[None]],
        serving: Callable[[T], Decision] | None = None,
        *,
        role: str | None = None,
        count_last_failure: bool = False,
    ) -> None:
        """``attempt`` what ``choose`` picks; when it fails before the first byte
        (UpstreamError), again on what it picks without the engines that failed, up to
        ``proxy.retries`` times. An engine that accepted the request and sent nothing in
        time is not retried (:meth:`not_retried`); no engine left is the last failure's
        status, or 503 if none was tried.

        ``choose`` picks a :class:`Decision`, or something ``serving`` names the serving
        engine's decision of (a split's plan: its decode engine). ``role``: the engines'
        role in the 503 and the log (``decode``). ``count_last_failure``: a failure
        that is not retried counts in ``kvroute_retries_total`` too (a split's decode
        engine's always has).
        """
        app = self.app
        retries = app.config.proxy.retries
        exclude: set[str] = set()
        last_error: UpstreamError | None = None
        for tries in range(1 + retries):
            try:
                chosen = await choose(exclude)
            except NoCandidates:
                break
            decision = serving(chosen) if serving is not None else cast("Decision", chosen)
            try:
                return await attempt(chosen)
            except UpstreamError as err:
                last_error = err
                exclude.add(decision.engine.endpoint)
                if err.accepted:
                    raise self.not_retried(err, ctx.request, decision) from None
                retrying = tries < retries
                if retrying or count_last_failure:
                    app.metrics.retries.labels(err.kind).inc()
                log.info(
                    "request %s: %s failed before the first byte (%s); %s",
                    ctx.request_id,
                    f"{role} engine {decision.engine.label}" if role else decision.engine.label,
                    err,
                    "retrying" if retrying else "giving up",
                )
        if last_error is not None:
            raise ApiError(last_error.http_status, f"engine failed: {last_error}")
        engines = f"{role} engine" if role else "engine"
        raise ApiError(503, f"no healthy {engines} serves model '{ctx.model}'", retry_after=1)

    def not_retried(
        self, err: UpstreamError, route_request: RouteRequest, decision: Decision
    ) -> ApiError:
        """The 504 of an engine that accepted the request but sent no first byte in time.

        Not resent elsewhere: the engine had it queued or running (its connection is
        closed, so it aborts), and the request's own size may be why it was slow, so
        another engine would make the client wait as long again.
        """
        self.app.metrics.first_byte_timeouts.labels(decision.engine.label).inc()
        log.warning(
            "request %s: %s accepted it but sent no first byte within %.1f s; aborted "
            "there and not retried on another engine",
            route_request.request_id,
            decision.engine.label,
            self.app.config.proxy.first_byte_timeout_s,
        )
        return ApiError(504, f"engine failed: {err} (not retried: the engine had accepted it)")

    async def attempt(
        self,
        ctx: RequestContext,
        decision: Decision,
        body: bytes | None = None,
        *,
        sink: Downstream | None = None,
        cached_tokens: int | None = None,
        tap: UsageTap | None = None,
        headers: dict[str, str] | None = None,
        upstream_headers: dict[str, str] | None = None,
    ) -> None:
        """One try of a generation on one engine. Raises UpstreamError while nothing
        reached the client.

        ``body`` (default: the client's request) goes to the engine, with
        ``upstream_headers``; the answer goes into ``sink`` (default: the client's) with
        ``headers``. ``cached_tokens`` overrides the decision's estimate in the load
        accounting (a decode leg whose KV is pulled prefills almost nothing); ``tap``
        sees and may rewrite the answer's usage.
        """
        app = self.app
        parsed, route_request, outcome = ctx.parsed, ctx.request, ctx.outcome
        sink = sink or ctx.sink
        body = ctx.body if body is None else body
        engine = app.registry.engine_of(decision.engine)
        assert engine is not None
        watch = ctx.watch(decision.engine) if ctx.watch is not None else None
        ticket = app.core.loads.begin(
            decision.engine,
            sum(len(p) for p in parsed.prompts) * parsed.n,
            decision.cached_tokens if cached_tokens is None else cached_tokens,
            route_request.max_tokens,
            route_request.flow if cached_tokens is None else None,  # not a decode leg
            sees_first_token=parsed.stream,
            # The first token of a decode leg is another engine's prefill; a Responses
            # stream's first bytes come before the prefill: neither times this engine.
            timed=parsed.stream and cached_tokens is None and ctx.path in _TIMED_PATHS,
        )
        sent = self.upstream_headers(
            sink.headers, route_request.request_id, engine, decision.engine, ctx.path
        )
        if upstream_headers:
            sent.update(upstream_headers)
        ours = {
            "x-request-id": route_request.request_id,
            "x-kvroute-engine": decision.engine.label,
            "x-kvroute-reason": outcome.reason(decision.summary()),
            **(headers or {}),
        }
        url = engine.url + ctx.path
        if engine.sglang and engine.dp_size > 1:
            body = with_dp_rank(body, decision.engine.rank)
        with await self.open(engine, url, body, sent, ticket) as call:
            if call.status >= 400:  # the engine refused the request itself: pass it on
                await self.pass_on(call, outcome, sink, ours)
                return
            if not parsed.stream:
                data = await call.read()
                if not self._check_tokenizer(parsed, data, outcome):
                    call.failed()
                    raise ApiError(502, f"the engine {engine.url} answered with invalid JSON")
                call.succeeded()
                outcome.set("ok", call.status)
                if tap is not None:
                    data = tap.answer(data)
                if watch is not None:
                    await watch.answer(data)
                await sink.whole(call.status, {**ours, "Content-Type": _JSON}, data)
                return
            await self.stream(ctx, call, sink, ours, tap, watch)

    async def _as_is(self, ctx: RequestContext, decision: Decision) -> None:
        """One try of an engine route's request on one engine; its answer goes to the
        client as it is, a stream relayed as a generation's. Raises UpstreamError while
        nothing reached the client."""
        app = self.app
        engine = app.registry.engine_of(decision.engine)
        assert engine is not None
        route_request = ctx.request
        ticket = app.core.loads.begin(decision.engine, route_request.prompt_tokens, 0, 0)
        sent = self.upstream_headers(
            ctx.sink.headers, ctx.request_id, engine, decision.engine, ctx.path
        )
        ours = {
            "x-request-id": ctx.request_id,
            "x-kvroute-engine": decision.engine.label,
            "x-kvroute-reason": ctx.outcome.reason(decision.summary()),
        }
        url = engine.url + ctx.path
        with await self.open(engine, url, ctx.body, sent, ticket) as call:
            streams = call.status < 400 and "event-stream" in call.content_type
            if ctx.parsed.stream and streams:
                await self.stream(ctx, call, ctx.sink, ours)
            else:
                await self.pass_on(call, ctx.outcome, ctx.sink, ours)

    async def stream(
        self,
        ctx: RequestContext,
        call: EngineCall,
        sink: Downstream,
        ours: dict[str, str],
        tap: UsageTap | None = None,
        watch: AnswerWatch | None = None,
    ) -> None:
        """Relay a generation's event stream (or an engine route's): checked as
        server-sent events, its first bytes before the client has any (UpstreamError if
        they fail), its ticket ended at its last event."""
        app = self.app
        parsed = ctx.parsed
        first = await call.first_chunk()
        idle = app.config.proxy.idle_timeout_s
        call.upstream.deadlines.touch(call.deadline, idle)
        if ctx.path == _MESSAGES and (engine_tokens := stream_input_tokens(first)) is not None:
            self._observe_tokens(parsed, engine_tokens)
        assert call.ticket is not None, "a generation's stream is charged to its engine"
        app.core.loads.prefilled(call.ticket)
        app.metrics.ttft_seconds.observe(time.perf_counter() - ctx.started)
        hooks = _Generation(self, ctx, call)
        head = {**ours, **SSE_HEADERS}
        tail = await call.relay(sink, head, hooks, idle, first=first, tap=tap, watch=watch)
        if tail is not None and parsed.include_usage:
            usage_at = tail.rfind(b'data: {"id"')
            if usage_at != -1 and b'"usage"' in tail[usage_at:]:
                usage = tail[usage_at + 6 :].split(b"\n\n", 1)[0]
                self._check_tokenizer(parsed, usage, ctx.outcome)

    async def pass_on(
        self, call: EngineCall, outcome: Outcome, sink: Downstream, ours: dict[str, str]
    ) -> None:
        """Read the engine's answer whole and pass it on as it is, status included (an
        engine's own refusal goes to the client as the engine wrote it)."""
        data = await call.read()
        call.succeeded()
        outcome.set("ok" if call.status < 400 else "client_error", call.status)
        await sink.whole(call.status, {**ours, "Content-Type": call.content_type}, data)

    async def open(
        self,
        engine: Engine,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        ticket: Ticket | None,
    ) -> EngineCall:
        """An :class:`EngineCall` to ``engine`` under ``ticket`` (None: the request puts
        nothing on the engine's load), its health the registry's."""
        upstream = self.app.upstream
        assert upstream is not None, "the router forwards once it has started"
        health = EngineHealth(self.app.registry, engine)
        return await EngineCall.open(
            upstream, url, body, headers, health=health, loads=self.app.core.loads, ticket=ticket
        )

    def upstream_headers(
        self,
        client: Mapping[str, str],
        request_id: str,
        engine: Any,
        key: EngineKey,
        path: str = "",
    ) -> dict[str, str]:
        """Headers every request to an engine carries (``client``: the client's headers,
        ``path``: the route it called, for where ``x-api-key`` is its key)."""
        headers = {"Content-Type": _JSON, "X-Request-Id": request_id}
        if engine.dp_size > 1:
            headers["X-data-parallel-rank"] = str(key.rank)
        auth = self.app.credentials.upstream_authorization_of(client, path)
        if auth:
            headers["Authorization"] = auth
        return headers

    def _check_tokenizer(
        self, parsed: ParsedRequest, answer: bytes, outcome: Outcome | None = None
    ) -> bool:
        """Compare our prompt-token count with the engine's ``usage`` (a JSON answer),
        which ``outcome`` keeps; False if ``answer`` is not JSON at all."""
        try:
            usage = _decode_usage(answer).usage
        except msgspec.ValidationError:  # JSON of another shape: not ours to judge
            return True
        except msgspec.DecodeError:
            return False
        if isinstance(usage, dict):
            if outcome is not None:
                outcome.usage = usage
            prompt_tokens = usage.get("prompt_tokens")
            if prompt_tokens is None:  # Anthropic's usage, or the Responses API's
                prompt_tokens = engine_input_tokens(usage)
            if isinstance(prompt_tokens, int) and not isinstance(prompt_tokens, bool):
                self._observe_tokens(parsed, prompt_tokens)
        return True

    def _observe_tokens(self, parsed: ParsedRequest, engine_tokens: int) -> None:
        # A continued Responses conversation's prompt holds what the engine stored.
        if parsed.model and parsed.previous_response_id is None:
            base = self.app.registry.base_of(parsed.model)
            self.app.tokenizers.observe(
                base, parsed.prompt_tokens, engine_tokens, media=bool(parsed.media)
            )

    def _gone_at_end(self, ctx: RequestContext) -> None:
        """The client left after the stream's last event, before its closing bytes: many
        clients close as they read ``data: [DONE]``. The answer was whole; counted, and
        logged at debug level only."""
        self.app.metrics.client_gone_at_end.inc()
        log.debug("client left after the last event of %s (%s)", ctx.path, ctx.request_id)

    def _done(self, ctx: RequestContext, ticket: Ticket, events: int, tail: bytes) -> None:
        """The engine has sent a stream's last event: the request leaves its load now,
        before the client has the event (a client may stop reading and send its next
        turn there; see :meth:`EngineCall.read`), with the output tokens its pace is
        learnt by."""
        ticket.output_tokens = _stream_tokens(ctx.path, events, tail, ctx.parsed.n)
        self.app.core.loads.end(ticket)


class _Generation(RelayHooks):
    """A generation's stream: its ticket leaves the engine's load at the last event, its
    outcome is counted, a break ends the client's stream with an error event in the
    route's form."""

    checked = True

    def __init__(self, forwarder: Forwarder, ctx: RequestContext, call: EngineCall) -> None:
        assert call.ticket is not None
        self.forwarder = forwarder
        self.ctx = ctx
        self.call = call
        self.ticket = call.ticket

    def ended(self, events: int, tail: bytes) -> None:
        if not self.ticket.released:
            self.forwarder._done(self.ctx, self.ticket, events, tail)

    def finished(self, events: int, tail: bytes) -> None:
        self.call.succeeded()
        self.ctx.outcome.set("ok", self.call.status)
        if not self.ticket.released:  # no end event seen: the stream's end is the answer's
            self.forwarder._done(self.ctx, self.ticket, events, tail)

    def broke(self, exc: HTTPError) -> bytes:
        self.call.failed()
        err = (
            ApiError(504, "the engine went quiet mid-stream")
            if self.call.deadline.expired
            else ApiError(502, f"the engine's stream broke: {exc}")
        )
        self.ctx.outcome.set("stream_error", err.status)
        self.call.done()  # the engine is done with it, before the client
        return shape_for(self.ctx.path).sse(err)

    def gone_at_end(self) -> None:  # what the client missed is the stream's framing
        self.ctx.outcome.set("ok", self.call.status)
        self.forwarder._gone_at_end(self.ctx)


def _stream_tokens(path: str, events: int, tail: bytes, n: int) -> int | None:
    """About how many tokens each sequence of a streamed completion or chat answer had,
    from its ``data:`` events (one token each, as vLLM streams): less the closing
    ``[DONE]``, a usage-only event, and a chat answer's role event per choice. None for
    other paths (their streams carry events that are no tokens)."""
    if path not in (_CHAT, _COMPLETIONS):
        return None
    tokens = events - (b"[DONE]" in tail) - (b'"usage":{' in tail)
    if path == _CHAT:
        tokens -= n
    return max(tokens // max(n, 1), 0)


class _WithUsage(msgspec.Struct):
    usage: dict[str, Any] | None = None


_decode_usage = msgspec.json.Decoder(_WithUsage).decode


def with_dp_rank(body: bytes, rank: int) -> bytes:
    """``body`` (a JSON object) with SGLang's ``data_parallel_rank`` set to ``rank``: an
    SGLang server with data-parallel ranks picks the rank from the body (vLLM reads the
    ``X-data-parallel-rank`` header, which is sent too). A body that is not a JSON
    object is sent as it is."""
    try:
        payload = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body
    if not isinstance(payload, dict):
        return body
    payload["data_parallel_rank"] = rank
    return msgspec.json.encode(payload)
