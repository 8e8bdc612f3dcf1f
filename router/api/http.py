"""The OpenAI-compatible HTTP API (aiohttp.web: it measured fastest, docs/benchmarks.md).

The request path: read and decode the body, tokenize the prompt, compute its block
keys, ask the routing core for an engine (:mod:`router.api.decide`, shared with the gRPC
and ext_proc front ends), forward the original bytes unchanged, and relay the answer.
The answer goes through a :class:`~router.api.downstream.Downstream`, so gRPC
``Generate`` runs this same forwarding code (:meth:`HttpApi.handle`).

A failure before the first byte reaches the client (connection refused, 5xx, 429,
timeout) is retried on another engine; after it, a stream ends with
an SSE error event and ``[DONE]``. A client that leaves cancels the handler, which
closes the upstream connection (the engine aborts) and releases the load it held.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router.api.downstream import Downstream
from router.api.errors import ApiError
from router.api.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ParsedRequest,
    check_limits,
    check_prompt_tokens,
    decode_body,
    parse_chat,
    parse_completion,
    resolve_model,
)
from router.api.usage import UsageTap
from router.engines.load import Ticket
from router.http1 import HTTPError, Response
from router.policy.base import Decision, NoCandidates, RouteRequest
from router.proxy import Deadline, UpstreamError
from router.types import EngineKey

if TYPE_CHECKING:
    from router.app import RouterApp

log = logging.getLogger("kvroute.http")

_encode = msgspec.json.Encoder().encode
_JSON = "application/json"
_SSE_FIELDS = (b"data:", b":", b"event:", b"id:", b"retry:")
"""What an event of a server-sent event stream starts with."""
_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")
"""What a request id may look like (it goes into headers and logs)."""
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=_encode(payload), status=status, content_type=_JSON, headers=headers)


def error_response(
    err: ApiError, request_id: str | None = None, extra_headers: dict[str, str] | None = None
) -> web.Response:
    headers: dict[str, str] = dict(extra_headers or {})
    if request_id:
        headers["x-request-id"] = request_id
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(int(err.retry_after), 1))
    return web.Response(body=err.body(), status=err.status, content_type=_JSON, headers=headers)


class HttpDownstream:
    """An aiohttp client as the :class:`Downstream` of a request."""

    __slots__ = ("request", "response")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    @property
    def headers(self) -> Any:
        return self.request.headers

    async def whole(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.response = web.Response(body=body, status=status, headers=headers)

    async def begin(self, status: int, headers: dict[str, str]) -> None:
        out = web.StreamResponse(status=status, headers=headers)
        await out.prepare(self.request)
        self.response = out

    async def write(self, chunk: bytes) -> None:
        assert self.response is not None
        try:
            await self.response.write(chunk)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            raise asyncio.CancelledError from None  # the client left while we wrote

    async def end(self) -> None:
        assert self.response is not None
        await self.response.write_eof()


class Outcome:
    """What finally happened to one request, for the requests metric."""

    __slots__ = ("outcome", "status")

    def __init__(self) -> None:
        self.outcome = "cancelled"
        self.status = 499

    def set(self, outcome: str, status: int) -> None:
        self.outcome, self.status = outcome, status

    def failed(self, err: ApiError) -> None:
        """The request ended with ``err`` before any answer."""
        if err.status == 429:
            self.set("rejected", 429)
        else:
            self.set(
                "client_error" if err.status < 500 else _server_outcome(err.status), err.status
            )


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Answer every failure in OpenAI's error form: unknown paths and methods included.

    An exception nobody expected is logged with its traceback and answered 503 (this
    router could not serve the request; another replica may), never 500.
    """
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        status = exc.status if exc.status in (400, 401, 403, 404, 405, 413, 429) else 400
        if status == 405:
            err = ApiError(404, f"{request.method} {request.path} is not supported")
        else:
            err = ApiError(status, exc.reason or "request rejected")
        return error_response(err, request.headers.get("x-request-id"))
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unexpected error serving %s %s", request.method, request.path)
        err = ApiError(503, "the router failed to serve this request", code="router_error")
        return error_response(err, request.headers.get("x-request-id"))


class HttpApi:
    """Handlers bound to one running router."""

    def __init__(self, app: RouterApp) -> None:
        from router.api.pd import PDForwarder

        self.app = app
        self.pd = PDForwarder(self)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/ready", self.ready),
            web.get("/metrics", self.metrics),
            web.get("/openapi.json", self.openapi),
        ]

    # ------------------------------------------------------------------ small endpoints

    async def models(self, request: web.Request) -> web.Response:
        created = int(self.app.started_at)
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": "kvroute"}
            for m in self.app.registry.models()
        ]
        return _json({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        healthy = self.app.registry.healthy_count()
        if self.app.draining or healthy == 0:
            reason = "draining" if self.app.draining else "no healthy engine"
            return _json({"status": "not ready", "reason": reason}, status=503)
        return _json({"status": "ready", "healthy_engines": healthy})

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.app.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def openapi(self, request: web.Request) -> web.Response:
        return _json(openapi_document())

    # ------------------------------------------------------------------ generation

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, route: str) -> web.StreamResponse:
        started = time.perf_counter()
        request_id = request.headers.get("x-request-id") or os.urandom(16).hex()
        outcome = Outcome()
        app = self.app
        admitted = False
        try:
            if not REQUEST_ID.fullmatch(request_id):
                bad = request_id
                request_id = os.urandom(16).hex()
                raise ApiError(
                    400, f"x-request-id must be 1-128 printable ASCII characters, got {bad[:40]!r}"
                )
            if app.draining:
                raise ApiError(503, "the router is shutting down", retry_after=1)
            # Admitted before the body is read: a waiting request holds no body in memory.
            deadline = app.admission.deadline(time.monotonic())
            await app.admission.enter(deadline)
            admitted = True
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise ApiError(
                    413, f"request body is larger than {app.config.limits.max_body_bytes} bytes"
                ) from None
            sink = HttpDownstream(request)
            await self.handle(sink, route, request_id, body, started, outcome, deadline)
            assert sink.response is not None
            return sink.response
        except ApiError as err:
            outcome.failed(err)
            return error_response(err, request_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            # The openai_errors middleware logs it and answers 503 router_error.
            outcome.set("router_error", 503)
            raise
        finally:
            if admitted:
                app.admission.leave()
            app.metrics.requests.labels(route, outcome.outcome, str(outcome.status)).inc()
            app.metrics.request_seconds.observe(time.perf_counter() - started)

    async def handle(
        self,
        sink: Downstream,
        route: str,
        request_id: str,
        body: bytes,
        started: float,
        outcome: Outcome,
        deadline: float | None = None,
    ) -> None:
        """Serve a completion (``route`` ``completions``) or chat (``chat``) request whose
        body has been read: parse, decide, forward, relay the answer into ``sink``.

        ``deadline`` (``time.monotonic``): how long the request may wait for an engine
        with room (``limits.max_inflight_per_engine``); None: 429 at once.
        Raises :class:`ApiError` while nothing has reached ``sink``.
        """
        app = self.app
        limits = app.config.limits
        payload = decode_body(body, limits.max_json_depth)
        parsed = (parse_chat if route == "chat" else parse_completion)(payload)
        check_limits(parsed, limits)
        model = resolve_model(parsed.model, app.registry.models())
        parsed.model = model
        route_request = await app.decider.prepare(
            request_id, model, parsed, sink.headers.get("x-session-id")
        )
        check_prompt_tokens(parsed, limits)
        route_request.wait_until = deadline
        if app.registry.is_disaggregated(model):
            await self.pd.forward(
                sink, _PATHS[route], parsed, route_request, payload, body, started, outcome
            )
        else:
            await self._forward(sink, route, model, parsed, route_request, body, started, outcome)

    def _check_tokenizer(self, parsed: ParsedRequest, answer: bytes) -> bool:
        """Compare our prompt-token count with the engine's ``usage`` (a JSON answer);
        False if ``answer`` is not JSON at all."""
        try:
            usage = _decode_usage(answer).usage
        except msgspec.ValidationError:  # JSON of another shape: not ours to judge
            return True
        except msgspec.DecodeError:
            return False
        if usage is not None and usage.prompt_tokens is not None and parsed.model:
            base = self.app.registry.base_of(parsed.model)
            self.app.tokenizers.observe(base, parsed.prompt_tokens, usage.prompt_tokens)
        return True

    async def _forward(
        self,
        sink: Downstream,
        route: str,
        model: str,
        parsed: ParsedRequest,
        route_request: RouteRequest,
        body: bytes,
        started: float,
        outcome: Outcome,
    ) -> None:
        app = self.app
        path = _PATHS[route]
        exclude: set[str] = set()
        last_error: UpstreamError | None = None
        for attempt in range(1 + app.config.proxy.retries):
            try:
                decision = await app.decider.choose(
                    route_request, app.decider.candidates(model, exclude=exclude)
                )
            except NoCandidates:
                if last_error is not None:
                    raise ApiError(last_error.http_status, f"engine failed: {last_error}") from None
                raise ApiError(
                    503, f"no healthy engine serves model '{model}'", retry_after=1
                ) from None
            if attempt == 0:
                app.metrics.routing_seconds.observe(time.perf_counter() - started)
                if route_request.prompt_tokens:
                    app.metrics.prefix_match.observe(
                        decision.cached_tokens / route_request.prompt_tokens
                    )
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("request %s: %s", route_request.request_id, decision.describe())
            try:
                return await self._attempt(
                    sink, path, parsed, route_request, decision, body, started, outcome
                )
            except UpstreamError as err:
                last_error = err
                exclude.add(decision.engine.endpoint)
                retrying = attempt < app.config.proxy.retries
                if retrying:
                    app.metrics.retries.labels(err.kind).inc()
                log.info(
                    "request %s: %s failed before the first byte (%s); %s",
                    route_request.request_id,
                    decision.engine.label,
                    err,
                    "retrying" if retrying else "giving up",
                )
        assert last_error is not None
        raise ApiError(last_error.http_status, f"engine failed: {last_error}")

    def upstream_headers(
        self, sink: Downstream, request_id: str, engine: Any, key: EngineKey
    ) -> dict[str, str]:
        """Headers every request to an engine carries."""
        headers = {"Content-Type": _JSON, "X-Request-Id": request_id}
        if engine.dp_size > 1:
            headers["X-data-parallel-rank"] = str(key.rank)
        auth = self.app.credentials.upstream_authorization(sink.headers.get("authorization"))
        if auth:
            headers["Authorization"] = auth
        return headers

    async def _attempt(
        self,
        sink: Downstream,
        path: str,
        parsed: ParsedRequest,
        route_request: RouteRequest,
        decision: Decision,
        body: bytes,
        started: float,
        outcome: Outcome,
        *,
        cached_tokens: int | None = None,
        tap: UsageTap | None = None,
        extra_headers: dict[str, str] | None = None,
    ) -> None:
        """One try on one engine. Raises UpstreamError while nothing reached the client.

        ``cached_tokens`` overrides the decision's estimate in the load accounting (a
        decode leg whose KV is pulled prefills almost nothing); ``tap`` sees and may
        rewrite the answer's usage.
        """
        app = self.app
        engine = app.registry.engine_of(decision.engine)
        assert engine is not None
        ticket = app.core.loads.begin(
            decision.engine,
            sum(len(p) for p in parsed.prompts) * parsed.n,
            decision.cached_tokens if cached_tokens is None else cached_tokens,
            route_request.max_tokens,
        )
        headers = self.upstream_headers(sink, route_request.request_id, engine, decision.engine)
        ours = {
            "x-request-id": route_request.request_id,
            "x-kvroute-engine": decision.engine.label,
            "x-kvroute-reason": decision.summary(),
            **(extra_headers or {}),
        }
        url = engine.url + path
        try:
            upstream, deadline = await app.upstream.open(url, body, headers)
        except UpstreamError:
            app.core.loads.end(ticket)
            app.registry.record_failure(engine)
            raise
        except BaseException:
            app.core.loads.end(ticket)
            raise
        try:
            if upstream.status >= 400:  # the engine refused the request itself: pass it on
                data = await self._read_all(upstream, deadline, engine, url)
                app.registry.record_success(engine)
                outcome.set("client_error", upstream.status)
                ctype = upstream.headers.get("content-type", _JSON)
                await sink.whole(upstream.status, {**ours, "Content-Type": ctype}, data)
                return
            if not parsed.stream:
                data = await self._read_all(upstream, deadline, engine, url)
                if not self._check_tokenizer(parsed, data):
                    app.registry.record_failure(engine)
                    raise ApiError(502, f"the engine {engine.url} answered with invalid JSON")
                app.registry.record_success(engine)
                outcome.set("ok", upstream.status)
                if tap is not None:
                    data = tap.answer(data)
                await sink.whole(upstream.status, {**ours, "Content-Type": _JSON}, data)
                return
            await self._relay(
                sink, parsed, upstream, deadline, engine, ticket, ours, started, outcome, tap
            )
        finally:
            app.upstream.finish(upstream, deadline)
            app.core.loads.end(ticket)

    async def _read_all(
        self, upstream: Response, deadline: Deadline, engine: Any, url: str
    ) -> bytes:
        try:
            return await self.app.upstream.read(upstream, deadline, url)
        except UpstreamError:
            self.app.registry.record_failure(engine)
            raise

    async def _relay(
        self,
        sink: Downstream,
        parsed: ParsedRequest,
        upstream: Response,
        deadline: Deadline,
        engine: Any,
        ticket: Ticket,
        ours: dict[str, str],
        started: float,
        outcome: Outcome,
        tap: UsageTap | None = None,
    ) -> None:
        """Stream the engine's SSE answer through, chunk by chunk."""
        app = self.app
        deadlines = app.upstream.deadlines
        try:
            first = await upstream.readany()
        except HTTPError as exc:
            app.registry.record_failure(engine)
            if deadline.expired:
                raise UpstreamError("timeout", "no first token in time") from None
            raise UpstreamError(
                "protocol", f"the stream broke before its first byte: {exc}"
            ) from None
        if not first:
            app.registry.record_failure(engine)
            raise UpstreamError("protocol", "the engine closed the stream without a byte")
        if not first.startswith(_SSE_FIELDS):
            app.registry.record_failure(engine)
            raise UpstreamError("protocol", "the engine's stream is not server-sent events")
        deadlines.touch(deadline, app.config.proxy.idle_timeout_s)
        app.core.loads.prefilled(ticket)
        app.metrics.ttft_seconds.observe(time.perf_counter() - started)
        await sink.begin(upstream.status, {**ours, **_SSE_HEADERS})
        await sink.write(tap.chunk(first) if tap is not None else first)
        tail = first
        try:
            while True:
                chunk = await upstream.readany()
                if not chunk:
                    break
                deadlines.touch(deadline)
                # An event starts where the last one ended: it must start with a field.
                if tail.endswith(b"\n\n") and not chunk.startswith(_SSE_FIELDS):
                    raise HTTPError(
                        "the engine sent bytes that are not server-sent events",
                        before_response=False,
                    )
                await sink.write(tap.chunk(chunk) if tap is not None else chunk)
                tail = chunk
        except HTTPError as exc:
            app.registry.record_failure(engine)
            err = (
                ApiError(504, "the engine went quiet mid-stream")
                if deadline.expired
                else ApiError(502, f"the engine's stream broke: {exc}")
            )
            outcome.set("stream_error", err.status)
            await sink.write(err.sse())
            await sink.end()
            return
        app.registry.record_success(engine)
        outcome.set("ok", upstream.status)
        await sink.end()
        if parsed.include_usage:
            usage_at = tail.rfind(b'data: {"id"')
            if usage_at != -1 and b'"usage"' in tail[usage_at:]:
                self._check_tokenizer(parsed, tail[usage_at + 6 :].split(b"\n\n", 1)[0])


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None


class _WithUsage(msgspec.Struct):
    usage: _Usage | None = None


_decode_usage = msgspec.json.Decoder(_WithUsage).decode


def _server_outcome(status: int) -> str:
    return {502: "engine_error", 503: "no_engine", 504: "timeout"}.get(status, "engine_error")


def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1 description of the router's HTTP API."""
    from pydantic.json_schema import models_json_schema

    _, defs = models_json_schema(
        [(CompletionRequest, "validation"), (ChatCompletionRequest, "validation")],
        ref_template="#/components/schemas/{model}",
    )
    error = {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "integer", "null"]},
                },
            }
        },
    }
    schemas = {**defs.get("$defs", {}), "Error": error}
    errors = {
        str(code): {
            "description": text,
            "content": {_JSON: {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        for code, text in (
            (400, "Invalid request"),
            (404, "Unknown model"),
            (413, "Body too large"),
            (429, "Too many requests in flight (see Retry-After)"),
            (502, "An engine failed"),
            (503, "No healthy engine"),
            (504, "An engine timed out"),
        )
    }

    def generate(model: str, summary: str) -> dict[str, Any]:
        return {
            "post": {
                "summary": summary,
                "requestBody": {
                    "required": True,
                    "content": {_JSON: {"schema": {"$ref": f"#/components/schemas/{model}"}}},
                },
                "responses": {
                    "200": {
                        "description": "The engine's answer (JSON, or SSE when streaming)",
                        "content": {
                            _JSON: {"schema": {"type": "object"}},
                            "text/event-stream": {
                                "schema": {
                                    "description": "One server-sent event: `data` holds a "
                                    "JSON chunk, an error object, or [DONE]",
                                    "type": "object",
                                    "required": ["data"],
                                    "properties": {"data": {"type": "string"}},
                                }
                            },
                        },
                    },
                    **errors,
                },
            }
        }

    def plain(summary: str, codes: tuple[str, ...] = ("200",)) -> dict[str, Any]:
        return {
            "get": {"summary": summary, "responses": {c: {"description": summary} for c in codes}}
        }

    return {
        "openapi": "3.1.0",
        "info": {"title": "kvroute", "version": __import__("router").__version__},
        "paths": {
            "/v1/completions": generate("CompletionRequest", "Create a completion"),
            "/v1/chat/completions": generate("ChatCompletionRequest", "Create a chat completion"),
            "/v1/models": plain("List served models"),
            "/health": plain("Liveness"),
            "/ready": plain("Readiness", ("200", "503")),
            "/metrics": plain("Prometheus metrics"),
        },
        "components": {"schemas": schemas},
    }
