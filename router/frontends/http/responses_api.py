"""The OpenAI Responses API: ``POST /v1/responses``, ``GET /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel``.

A new response takes the request path every generation takes (parse, validate,
``Decider.prepare``, the planner, forward and relay,
:class:`~router.serving.generate.Generations`); its prompt is tokenized from
``instructions`` and ``input`` (:mod:`router.tokenization.responses_input`; the engine's own
renderer where it serves one). Two things are its own:

* **Affinity.** vLLM keeps a stored response in the engine that produced it, so a
  request with ``previous_response_id`` can only be served there. The router learns
  each response's id from the engine's answer (the ``id`` of a JSON answer, the
  ``response.created`` / ``response.completed`` event of a stream) into the
  :class:`~router.response_store.ResponseStore`, and plans a continued conversation
  within that one engine. An id nobody recorded (or expired), or whose engine is no
  longer healthy or no longer serves the model, is routed as any request, and counted
  (``kvroute_responses_affinity_total``): the engine then answers for it.
* **Retrieval.** ``GET`` and ``cancel`` go to the engine holding the id, or are a 404
  in OpenAI's error form when the router knows none.
* **Asking.** An id no replica remembers (its write to Redis was lost while Redis was
  away, or it predates this router) is looked for on the engines themselves: up to
  ``responses.ask_engines`` healthy ones are asked at once (``GET
  /v1/responses/{id}``, the client's credentials), the first ``200`` names the holder,
  and the answer is remembered (``kvroute_responses_engine_queries_total``). At most
  ``responses.ask_per_second`` ids are asked about a second, and
  ``responses.ask_per_caller_per_second`` for one caller (its API key, else its
  address): made-up ids cannot turn one client's requests into many times as many to
  the engines, nor use up the questions of the others.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from router.fleet.registry import Engine, EngineState
from router.flow.ratelimit import Limit, LocalBuckets
from router.frontends.http.downstream import HttpDownstream
from router.http1 import HTTPError
from router.plan import SERVING_ROLES
from router.proxy import UpstreamError
from router.response_store import RESPONSE_ID, ResponseStore
from router.serving.context import Outcome, RequestContext
from router.serving.errors import ApiError, bad_request
from router.serving.parsing import MIN_OUTPUT_TOKENS, ParsedRequest, optional_int
from router.serving.relay import RelayHooks, relay
from router.tokenization.responses_input import InvalidInput, responses_messages
from router.types import EngineKey

if TYPE_CHECKING:
    from router.serving.services import Services

_decode = msgspec.json.decode
_JSON = "application/json"

RENDERED = ("input", "instructions", "tools", "tool_choice", "chat_template_kwargs", "reasoning")
"""The fields of a Responses request its rendering reads (the engine's renderer is
sent these alone: it refuses ``previous_response_id``)."""

_MARKS = (b'"response.created"', b'"response.completed"', b'"response.in_progress"')
"""Events of a stream that carry the whole response object, id included."""
_MAX_PENDING = 1 << 20
"""A stream's bytes kept while looking for its id (an event split across chunks)."""
_ASKING = Limit("responses:ask", 1, 1, "requests", "the router")
"""The bucket of questions to the engines (``responses.ask_per_second``)."""
_CALLERS_KEPT = 4096
"""Callers' buckets kept before the full ones are dropped (then twice what remains)."""


def _opt(payload: dict[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = payload.get(name)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise bad_request(f"'{name}' must be {what}", name)
    return value


def parse_responses(payload: dict[str, Any]) -> ParsedRequest:
    """The routing facts of a ``POST /v1/responses`` body (400 for what routing cannot
    read; the engine validates the rest)."""
    raw_input = payload.get("input")
    if not isinstance(raw_input, (str, list)):
        raise bad_request("'input' must be a string or a list of input items", "input")
    instructions = _opt(payload, "instructions", str, "a string")
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    max_output = optional_int(payload, "max_output_tokens", MIN_OUTPUT_TOKENS)
    kwargs = _opt(payload, "chat_template_kwargs", dict, "an object")
    try:
        messages = responses_messages(instructions, raw_input)
    except InvalidInput as exc:
        raise bad_request(str(exc), "input") from None
    if not messages:
        raise bad_request("'input' must hold at least one item", "input")
    parsed = ParsedRequest(
        _opt(payload, "model", str, "a string"),
        bool(stream),
        None,
        1,
        _opt(payload, "cache_salt", str, "a string"),
        _opt(payload, "user", str, "a string"),
        False,
        messages=messages,
        template_kwargs=kwargs,
        max_output_tokens=max_output,
        responses={k: payload[k] for k in RENDERED if k in payload},
        previous_response_id=_opt(payload, "previous_response_id", str, "a string"),
    )
    return parsed


class ResponseIdWatch:
    """Sees one engine's answer to a new response and records its id there."""

    __slots__ = ("endpoint", "learned", "pending", "store")

    def __init__(self, store: ResponseStore, endpoint: str) -> None:
        self.store = store
        self.endpoint = endpoint
        self.learned = False
        self.pending = b""

    async def _learn(self, response: Any) -> None:
        if isinstance(response, dict) and isinstance(response.get("id"), str):
            self.learned = True
            await self.store.remember(response["id"], self.endpoint)

    async def answer(self, body: bytes) -> None:
        """A whole JSON answer: the response object."""
        try:
            obj = _decode(body)
        except msgspec.DecodeError:
            return
        if isinstance(obj, dict) and obj.get("object") == "response":
            await self._learn(obj)

    async def chunk(self, chunk: bytes) -> None:
        """Part of a stream: the first event holding the response object names it."""
        if self.learned:
            return
        data = self.pending + chunk
        *events, self.pending = data.split(b"\n\n")
        if len(self.pending) > _MAX_PENDING:
            self.learned, self.pending = True, b""  # not a stream we can read: give up
        for event in events:
            if not any(mark in event for mark in _MARKS):
                continue
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    try:
                        obj = _decode(line[5:])
                    except msgspec.DecodeError:
                        continue
                    if isinstance(obj, dict):
                        await self._learn(obj.get("response"))
                    if self.learned:
                        self.pending = b""
                        return


class ResponsesApi:
    """The Responses routes of one router's HTTP API."""

    def __init__(self, app: Services) -> None:
        self.app = app
        self._asking: set[asyncio.Future[str | None]] = set()
        self._questions = LocalBuckets()
        self._callers = LocalBuckets()
        self._callers_kept = _CALLERS_KEPT

    @property
    def store(self) -> ResponseStore:
        return self.app.responses

    def routes(self) -> list[web.RouteDef]:
        """Retrieval and cancellation (``POST /v1/responses`` is a generation route of the
        HTTP API, with :meth:`attach` before its plan)."""
        return [
            web.get("/v1/responses/{response_id}", self.retrieve),
            web.post("/v1/responses/{response_id}/cancel", self.cancel),
        ]

    async def attach(self, ctx: RequestContext) -> None:
        """Before planning: keep a continued conversation on its engine, and learn the
        id of what the engine answers."""
        if ctx.payload.get("store", True) is not False:
            store = self.store

            def watch(engine: EngineKey) -> ResponseIdWatch:
                return ResponseIdWatch(store, engine.endpoint)

            ctx.watch = watch
        previous = ctx.parsed.previous_response_id
        if previous is None:
            return
        counter = self.app.metrics.responses_affinity
        serving = self.app.decider.planner.candidates(ctx.model, SERVING_ROLES)
        caller = self.app.credentials.caller_of(ctx.sink.headers, "/v1/responses", ctx.sink.peer)
        endpoint = await self.locate(
            previous, (key.endpoint for key in serving), ctx.sink.headers, "/v1/responses", caller
        )
        if endpoint is None:
            counter.labels("unknown").inc()
            return
        if not any(key.endpoint == endpoint for key in serving):
            counter.labels("engine_unavailable").inc()
            return
        counter.labels("pinned").inc()
        ctx.subset = {endpoint}
        # The engine's prompt starts with the stored conversation, which the router does
        # not see: the keys of this request's own input would record blocks it never
        # holds. The pin routes it, not a prefix match.
        ctx.request.keys = []

    async def locate(
        self,
        response_id: str,
        endpoints: Iterable[str],
        headers: Mapping[str, str],
        path: str,
        caller: str,
    ) -> str | None:
        """The endpoint of the engine holding ``response_id``: remembered (here or in
        Redis), or else found by asking the healthy engines among ``endpoints`` (the
        first ``200`` wins, and is remembered); None when none holds it.

        ``headers`` and ``path``: the client's call, whose credentials the engines see;
        ``caller``: who makes it (:meth:`Credentials.caller_of`), for its share.
        """
        endpoint = await self.store.engine_of(response_id)
        if endpoint is not None:
            return endpoint
        app = self.app
        config = self.store.config  # the section as started (restart to change)
        if config.ask_engines == 0 or not RESPONSE_ID.fullmatch(response_id):
            return None
        engines = [
            engine
            for engine in map(app.registry.get, dict.fromkeys(endpoints))
            if engine is not None and engine.state is EngineState.HEALTHY
        ][: config.ask_engines]
        if not engines:
            return None
        if not self._may_ask(caller):
            app.metrics.responses_queries.labels("not_asked").inc()
            return None
        auth = app.credentials.upstream_authorization_of(headers, path)
        upstream = app.upstream
        assert upstream is not None

        async def ask(engine: Engine) -> str | None:
            url = f"{engine.url}/v1/responses/{response_id}"
            try:
                status, _ = await upstream.get(url, config.ask_timeout_s, auth)
            except UpstreamError:
                return None
            return engine.endpoint if status == 200 else None

        pending = {asyncio.ensure_future(ask(engine)) for engine in engines}
        # Questions still on their way when an answer is found (or the client leaves)
        # end by themselves, each within ``ask_timeout_s``: kept until then.
        for task in pending:
            self._asking.add(task)
            task.add_done_callback(self._asking.discard)
        found: str | None = None
        while pending and found is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            found = next((e for e in (task.result() for task in done) if e is not None), None)
        app.metrics.responses_queries.labels("found" if found else "not_found").inc()
        if found is not None:
            await self.store.remember(response_id, found)
        return found

    def _may_ask(self, caller: str) -> bool:
        """Take one question from the caller's bucket and the router's, or from none."""
        config = self.store.config
        rate, mine = config.ask_per_second, config.ask_per_caller_per_second
        cap = max(1.0, mine)
        own = Limit(f"responses:ask:{caller}", 1, 1, "requests", caller)
        if self._callers.take([(own, mine, cap)])[0] >= 0:
            return False
        if self._questions.take([(_ASKING, rate, max(1.0, rate))])[0] >= 0:
            self._callers.add([(Limit(own.bucket, 1, -1, "requests", caller), mine, cap)])
            return False
        if len(self._callers) > self._callers_kept:
            self._callers.forget_full(mine, cap)
            self._callers_kept = max(_CALLERS_KEPT, 2 * len(self._callers))
        return True

    # ------------------------------------------------------------------ retrieval

    async def retrieve(self, request: web.Request) -> web.StreamResponse:
        return await self._to_holder(request, "GET", "")

    async def cancel(self, request: web.Request) -> web.StreamResponse:
        return await self._to_holder(request, "POST", "/cancel")

    async def _to_holder(
        self, request: web.Request, method: str, suffix: str
    ) -> web.StreamResponse:
        """Forward ``request`` to the engine holding its response, relaying the answer
        (JSON, or the events of a background response's stream)."""
        app = self.app
        started = time.perf_counter()
        route = "responses_cancel" if suffix else "responses_get"
        outcome = Outcome()
        try:
            response_id = request.match_info["response_id"]
            endpoint = await self.locate(
                response_id,
                (engine.endpoint for engine in app.registry),
                request.headers,
                request.path,
                app.credentials.caller_of(request.headers, request.path, request.remote),
            )
            engine = app.registry.get(endpoint) if endpoint is not None else None
            if engine is None:
                raise ApiError(
                    404,
                    f"Response with id '{response_id}' not found.",
                    param="response_id",
                    code="response_not_found",
                )
            if engine.state is not EngineState.HEALTHY:
                raise ApiError(
                    503,
                    f"the engine holding response '{response_id}' is unavailable",
                    retry_after=1,
                )
            body = await request.read() if method == "POST" else b""
            url = f"{engine.url}/v1/responses/{response_id}{suffix}"
            if request.query_string:
                url += "?" + request.query_string
            out = await self._exchange(request, engine, url, method, body)
            status = out.status
            outcome.set(
                "ok" if status < 400 else "client_error" if status < 500 else "engine_error", status
            )
            return out
        except ApiError as err:
            outcome.failed(err)
            headers = {"Retry-After": str(int(err.retry_after))} if err.retry_after else {}
            return web.Response(
                body=err.body(), status=err.status, content_type=_JSON, headers=headers
            )
        finally:
            app.metrics.requests.labels(route, outcome.outcome, str(outcome.status)).inc()
            app.metrics.request_seconds.observe(time.perf_counter() - started)

    async def _exchange(
        self, request: web.Request, engine: Engine, url: str, method: str, body: bytes
    ) -> web.StreamResponse:
        """``method`` ``url`` on the holding engine, its answer relayed as it is.

        Opened here, not as an :class:`~router.serving.forward.EngineCall` (a POST whose
        5xx is a failure to retry): a GET or a cancel goes to the one engine holding the
        response, and whatever it answers, 5xx included, is the client's answer."""
        app = self.app
        upstream = app.upstream
        assert upstream is not None
        request_id = request.headers.get("x-request-id") or ""
        headers = {"Content-Type": _JSON}
        if request_id:
            headers["X-Request-Id"] = request_id
        auth = app.credentials.upstream_authorization_of(request.headers, request.path)
        if auth:
            headers["Authorization"] = auth
        deadline = upstream.deadlines.start(app.config.proxy.first_byte_timeout_s)
        ours = {"x-kvroute-engine": engine.endpoint}
        try:
            answer = await upstream.client.request(method, url, body, headers, deadline)
        except HTTPError as exc:
            upstream.deadlines.stop(deadline)
            app.registry.record_failure(engine)
            raise ApiError(502, f"engine failed: {url}: {exc}") from None
        sink = HttpDownstream(request, gone_at_end=app.metrics.client_gone_at_end.inc)
        try:
            ctype = answer.headers.get("content-type", _JSON)
            if not ctype.startswith("text/event-stream"):
                await sink.whole(
                    answer.status, {**ours, "Content-Type": ctype}, await answer.read()
                )
            else:
                # A stored response's stream as it is: one that breaks ends where it stopped.
                idle = app.config.proxy.idle_timeout_s
                upstream.deadlines.touch(deadline, idle)
                await relay(
                    upstream.deadlines,
                    answer,
                    deadline,
                    idle,
                    sink,
                    {**ours, "Content-Type": ctype},
                    RelayHooks(),
                )
            assert sink.response is not None
            return sink.response
        except HTTPError as exc:
            raise ApiError(502, f"engine failed: {url}: {exc}") from None
        finally:
            upstream.finish(answer, deadline)
