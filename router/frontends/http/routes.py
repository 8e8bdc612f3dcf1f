"""The OpenAI-compatible HTTP API (aiohttp.web: it measured fastest, docs/benchmarks.md).

The request path: admit the request and read its body (here), then decode it, tokenize
the prompt, compute its block keys, ask the routing core for an engine
(:mod:`router.serving.decide`, shared with the gRPC and ext_proc front ends), forward the
original bytes unchanged, and relay the answer (:mod:`router.serving.generate`,
:mod:`router.serving.forward`, :mod:`router.serving.relay`). The answer goes through a
:class:`~router.serving.downstream.Downstream`, so gRPC ``Generate`` runs this same
forwarding code.

A failure before the first byte reaches the client (connection refused or timed out,
5xx, 429) is retried on another engine; a first-byte timeout after the engine had the
request is not (504: it had the work queued, see :meth:`Forwarder.not_retried`). After the
first byte, a stream ends with an SSE error event and ``[DONE]``. A client that leaves
cancels the handler, which closes the upstream connection (the engine aborts) and
releases the load it held.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router.frontends.http.anthropic import (
    COUNT_TOKENS_PATH,
    MESSAGES_PATH,
    CountTokens,
    parse_messages,
)
from router.frontends.http.body import read_body
from router.frontends.http.downstream import HttpDownstream
from router.frontends.http.engine_routes import (
    ENGINE_ROUTES,
    NOT_ROUTED,
    EngineRoute,
    unknown_route,
)
from router.frontends.http.openapi import openapi_document
from router.frontends.http.passthrough import Passthrough, refusing
from router.frontends.http.responses_api import ResponsesApi, parse_responses
from router.serving.context import Outcome
from router.serving.downstream import Downstream
from router.serving.errors import ApiError, shape_for
from router.serving.forward import Forwarder
from router.serving.gate import Entry, Permit
from router.serving.generate import BeforePlan, Generations
from router.serving.headers import REQUEST_ID, check_headers
from router.serving.intake import Parse
from router.serving.parsing import parse_chat, parse_completion

if TYPE_CHECKING:
    from router.serving.services import Services

log = logging.getLogger("kvroute.http")

_encode = msgspec.json.Encoder().encode
_JSON = "application/json"
_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": MESSAGES_PATH,
    "responses": "/v1/responses",
}
_PARSERS: dict[str, Parse] = {
    "chat": parse_chat,
    "completions": parse_completion,
    "messages": parse_messages,
    "responses": parse_responses,
}

#: Serves a request whose body has been read: (sink, route label, request id, body,
#: start time, outcome, admission deadline), as :meth:`Passthrough.handle`.
Handler = Callable[[Downstream, str, str, bytes, float, Outcome, float | None], Awaitable[None]]


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=_encode(payload), status=status, content_type=_JSON, headers=headers)


def error_response(
    err: ApiError,
    request_id: str | None = None,
    extra_headers: dict[str, str] | None = None,
    path: str = "",
) -> web.Response:
    """``err`` as the API served at ``path`` writes errors (:func:`shape_for`)."""
    headers: dict[str, str] = dict(extra_headers or {})
    if request_id:
        headers["x-request-id"] = request_id
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(int(err.retry_after), 1))
    body = shape_for(path).body(err)
    return web.Response(body=body, status=err.status, content_type=_JSON, headers=headers)


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Answer every failure in the error form of the route's API (OpenAI's, Anthropic's on
    /v1/messages): unknown paths and methods included.

    Client headers the router reads or forwards are checked first (400 unless printable
    ASCII). An exception nobody expected is logged with its traceback and answered 503
    (this router could not serve the request; another replica may), never 500.
    """
    try:
        check_headers(request.headers)
        return await handler(request)
    except ApiError as err:
        return error_response(err, path=request.path)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        status = exc.status if exc.status in (400, 401, 403, 404, 405, 413, 429) else 400
        if status == 405:
            err = ApiError(404, f"{request.method} {request.path} is not supported")
        elif status == 404:  # no route matched: not guessed at, not forwarded
            err = unknown_route(request.method, request.path)
        else:
            err = ApiError(status, exc.reason or "request rejected")
        return error_response(err, request.headers.get("x-request-id"), path=request.path)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unexpected error serving %s %s", request.method, request.path)
        err = ApiError(503, "the router failed to serve this request", code="router_error")
        return error_response(err, request.headers.get("x-request-id"), path=request.path)


class HttpApi:
    """Handlers bound to one running router."""

    def __init__(self, app: Services) -> None:
        self.app = app
        self.forwarder = Forwarder(app)
        self.generations = Generations(app, self.forwarder)
        self.passthrough = Passthrough(app, self.forwarder)
        self.responses = ResponsesApi(app)
        self.count_tokens = CountTokens(app, self.forwarder)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post(MESSAGES_PATH, self.messages),
            web.post(COUNT_TOKENS_PATH, self.count_tokens.handle),
            web.post("/v1/responses", self.create_response),
            *self.responses.routes(),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model:.+}", self.model),  # ids may hold slashes
            web.get("/health", self.health),
            web.get("/ready", self.ready),
            web.get("/metrics", self.metrics),
            web.get("/openapi.json", self.openapi),
            *self._engine_routes(),  # every other engine route (engine_routes.py)
        ]

    def _engine_routes(self) -> list[web.RouteDef]:
        """The routes of :data:`ENGINE_ROUTES`, passed through
        (:mod:`router.frontends.http.passthrough`), and of :data:`NOT_ROUTED`, refused."""

        def serving(route: EngineRoute) -> Any:
            serve = functools.partial(self.passthrough.handle, route)

            async def handler(request: web.Request) -> web.StreamResponse:
                return await self._generate(request, route.label, serve)

            return handler

        served = [web.post(route.path, serving(route)) for route in ENGINE_ROUTES]
        refused = [web.route(n.method, n.path, refusing(n)) for n in NOT_ROUTED]
        return served + refused

    # ------------------------------------------------------------------ small endpoints

    def _model_card(self, model: str) -> dict[str, Any]:
        created = int(self.app.started_at)
        return {"id": model, "object": "model", "created": created, "owned_by": "kvroute"}

    async def models(self, request: web.Request) -> web.Response:
        data = [self._model_card(m) for m in self.app.registry.models()]
        return _json({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{model}``: its entry of :meth:`models`, or OpenAI's 404."""
        model = request.match_info["model"]
        if model not in self.app.registry.models():
            raise ApiError(
                404,
                f"The model '{model}' does not exist",
                param="model",
                code="model_not_found",
            )
        return _json(self._model_card(model))

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

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "messages")

    async def create_response(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/responses``: a generation, kept on the engine of the conversation it
        continues and its answer's id learnt (:meth:`ResponsesApi.attach`)."""
        return await self._generate(request, "responses", before_plan=self.responses.attach)

    async def _generate(
        self,
        request: web.Request,
        route: str,
        handle: Handler | None = None,
        *,
        before_plan: BeforePlan | None = None,
    ) -> web.StreamResponse:
        """Admit a client request, read its body and serve it with ``handle`` (default:
        the generation path of completions, chat, Messages and Responses,
        :meth:`Generations.serve`, with ``before_plan``); ``route`` is its metrics label."""
        started = time.perf_counter()
        request_id = request.headers.get("x-request-id") or os.urandom(16).hex()
        outcome = Outcome()
        app = self.app
        gate = app.gate
        permit = Permit()
        try:
            if not REQUEST_ID.fullmatch(request_id):
                bad = request_id
                request_id = os.urandom(16).hex()
                raise ApiError(
                    400, f"x-request-id must be 1-128 printable ASCII characters, got {bad[:40]!r}"
                )
            gate.refuse_closed()
            deadline = gate.deadline()
            await gate.enter(
                Entry(request.headers, read=lambda: read_body(request)), deadline, permit
            )
            outcome.ticket = permit.ticket
            body = permit.body
            sink = HttpDownstream(request)
            if handle is not None:
                await handle(sink, route, request_id, body, started, outcome, deadline)
            else:
                await self.generations.serve(
                    sink,
                    _PATHS[route],
                    _PARSERS[route],
                    request_id,
                    body,
                    started,
                    outcome,
                    deadline,
                    before_plan,
                )
            assert sink.response is not None
            return sink.response
        except ApiError as err:
            outcome.failed(err)
            return error_response(err, request_id, path=request.path)
        except asyncio.CancelledError:
            raise
        except Exception:
            # The openai_errors middleware logs it and answers 503 router_error.
            outcome.set("router_error", 503)
            raise
        finally:
            gate.leave(permit, outcome.usage)
            app.metrics.requests.labels(route, outcome.outcome, str(outcome.status)).inc()
            app.metrics.request_seconds.observe(time.perf_counter() - started)
