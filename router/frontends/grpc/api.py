"""kvroute.v1 over gRPC: the Router service (Pick, Generate, Release) and Admin.

``Pick`` prepares and plans exactly as the HTTP API does (:mod:`router.serving.decide`,
:mod:`router.plan`), says what a split's handoff dialect needs sent
(:meth:`~router.handoff.base.Handoff.directions`) and holds the chosen engines' load
until ``Release`` (or expiry, :mod:`router.serving.picks`).
``Generate`` is the HTTP API's own forwarding path
(:class:`~router.serving.generate.Generations`) writing into the call's stream. Admin
calls go through :mod:`router.admin`, like ``/admin/engines``.

Errors are gRPC status codes with a message: the HTTP API's 400 is INVALID_ARGUMENT,
404 NOT_FOUND, 429 RESOURCE_EXHAUSTED, 502/503 UNAVAILABLE, 504 DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from grpc import aio

from router.admin import AdminError, endpoint_key
from router.grpc.gen.kvroute.v1 import router_pb2 as pb
from router.grpc.gen.kvroute.v1 import router_pb2_grpc as pb_grpc
from router.handoff import registry as dialects
from router.handoff.base import Directions
from router.plan import Plan
from router.policy.base import Decision, NoCandidates, RouteRequest
from router.serving.context import Outcome
from router.serving.errors import ApiError, bad_request
from router.serving.forward import Forwarder
from router.serving.gate import Entry, Permit
from router.serving.generate import Generations
from router.serving.headers import REQUEST_ID, check_headers
from router.serving.intake import Parse, prepare
from router.serving.parsing import decode_body, parse_chat, parse_completion
from router.serving.picks import DuplicatePick
from router.serving.validate import check_keyed, resolve_model
from router.types import EngineKey

if TYPE_CHECKING:
    from router.serving.services import Services

log = logging.getLogger("kvroute.grpc")
T = TypeVar("T")

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ALREADY_EXISTS,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
_MODES = {"aggregated": pb.MODE_AGGREGATED, "local": pb.MODE_LOCAL, "split": pb.MODE_SPLIT}
_ROUTES = {pb.ENDPOINT_COMPLETIONS: "completions", pb.ENDPOINT_CHAT_COMPLETIONS: "chat"}
_GENERATIONS: dict[str, tuple[str, Parse]] = {
    "completions": ("/v1/completions", parse_completion),
    "chat": ("/v1/chat/completions", parse_chat),
}
"""What ``Generate`` serves: each route's engine path and parser, as the HTTP API's."""


def status_code(http_status: int) -> grpc.StatusCode:
    """The gRPC code of an HTTP API status."""
    return _CODES.get(http_status, grpc.StatusCode.UNAVAILABLE)


def _metadata(context: aio.ServicerContext) -> dict[str, str]:
    return {
        key.lower(): value
        for key, value in (context.invocation_metadata() or ())
        if isinstance(value, str)
    }


def _headers(fields: Mapping[str, str]) -> dict[str, str]:
    """Headers with their names lower-cased (a protobuf map iterates through the
    Mapping mixins, slowly: an empty one is not iterated)."""
    return {k.lower(): v for k, v in fields.items()} if fields else {}


def _caller_deadline(context: aio.ServicerContext) -> float | None:
    """When the caller's deadline passes (``time.monotonic``), if it set one."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


async def _call(app: Services, method: str, context: aio.ServicerContext, work: Awaitable[T]) -> T:
    """Run one RPC: count it, and turn a refusal into its status code and message."""
    try:
        result = await work
    except (ApiError, AdminError) as err:
        code = status_code(err.status)
        app.metrics.grpc_requests.labels(method, code.name).inc()
        await context.abort(code, err.message)
        raise AssertionError("unreachable") from None  # abort raises
    except NoCandidates as exc:
        app.metrics.grpc_requests.labels(method, "UNAVAILABLE").inc()
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        raise AssertionError("unreachable") from None
    except Exception:  # a bug: log it, answer like the HTTP API's 503, never a trace
        log.exception("unexpected error serving %s", method)
        app.metrics.grpc_requests.labels(method, "UNAVAILABLE").inc()
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the router failed to serve this call")
        raise AssertionError("unreachable") from None
    app.metrics.grpc_requests.labels(method, "OK").inc()
    return result


# --------------------------------------------------------------------------- messages


def _decision(decision: Decision, out: pb.Decision) -> None:
    """Write ``decision`` into ``out`` (filling a message in place costs about half of
    building nested messages and copying them in)."""
    out.policy = decision.policy
    out.reason = decision.reason
    out.summary = decision.summary()
    out.matched_blocks = decision.matched_blocks
    out.cached_tokens = decision.cached_tokens
    add = out.scores.add
    for s in decision.scores:
        add(
            endpoint=s.engine.endpoint,
            dp_rank=s.engine.rank,
            matched_blocks=s.matched_blocks,
            cached_tokens=s.cached_tokens,
            queue=s.queue,
            prefill=s.prefill,
            decode=s.decode,
            reported=s.reported,
            total=s.total,
        )


def _target(app: Services, decision: Decision, out: pb.Target) -> None:
    engine = app.registry.engine_of(decision.engine)
    out.endpoint = decision.engine.endpoint
    out.url = engine.url if engine else ""
    out.dp_rank = decision.engine.rank
    out.dp_size = engine.dp_size if engine else 1
    out.role = engine.role if engine else ""
    _decision(decision, out.decision)


def _directions(app: Services, plan: Plan) -> Directions | None:
    """What the plan's handoff dialect asks the caller to send, when it splits."""
    if plan.prefill is None or plan.dialect is None:
        return None
    prefill = app.registry.engine_of(plan.prefill.engine)
    return dialects.get(plan.dialect).directions(plan, prefill)


def routing_headers(app: Services, plan: Plan, directions: Directions | None) -> dict[str, str]:
    """Headers a request sent to the plan's serving engine carries (``directions``: the
    plan's :func:`_directions`)."""
    headers = {"x-request-id": plan.route.request_id}
    engine = app.registry.engine_of(plan.decode.engine)
    if engine is not None and engine.dp_size > 1:
        headers["X-data-parallel-rank"] = str(plan.decode.engine.rank)
    if directions is not None:
        headers.update(directions.headers)
    return headers


def pick_response(app: Services, plan: Plan, fallbacks: list[str]) -> pb.PickResponse:
    directions = _directions(app, plan)
    response = pb.PickResponse(
        request_id=plan.route.request_id,
        model=plan.model,
        mode=_MODES[plan.mode],
        headers=routing_headers(app, plan, directions),
        fallbacks=fallbacks,
        prompt_tokens=plan.load_tokens,
        approximate=plan.route.approximate,
        expires_in_s=app.picks.ttl_s,
    )
    _target(app, plan.decode, response.decode)
    if plan.prefill is not None:
        _target(app, plan.prefill, response.prefill)
    if plan.split is not None:
        s = plan.split
        response.split.CopyFrom(
            pb.Split(
                split=s.split,
                reason=s.reason,
                uncached_tokens=s.uncached_tokens,
                transfer_s=s.transfer_s,
                saved_s=s.saved_s,
            )
        )
    if directions is not None:
        response.handoff.CopyFrom(pb.Handoff(**directions.pick))
    return response


def fallbacks(plan: Plan, candidates: Callable[[], list[EngineKey]], limit: int) -> list[str]:
    """Other engines the request could go to (``host:port``), cheapest first: by the
    decision's scores, or (a decision without scores) in ``candidates()``' order."""
    chosen = plan.decode.engine.endpoint
    order = (
        [s.engine for s in sorted(plan.decode.scores, key=lambda s: s.total)]
        if plan.decode.scores
        else candidates()
    )
    out: list[str] = []
    for key in order:
        if key.endpoint != chosen and key.endpoint not in out:
            out.append(key.endpoint)
            if len(out) >= limit:
                break
    return out


def _engine_status(entry: Mapping[str, Any]) -> pb.EngineStatus:
    status = pb.EngineStatus(
        endpoint=entry["endpoint"],
        url=entry["url"],
        role=entry["role"],
        state=entry["state"],
        models=entry["models"],
        dp_size=entry["dp_size"],
        inflight_requests=entry["inflight_requests"],
        refused_reason=entry["refused_reason"],
        discovered=entry["discovered"],
    )
    if entry["index_blocks"] is not None:
        status.index_blocks = entry["index_blocks"]
        status.index_share = entry["index_share"]
    if entry.get("topology"):
        status.topology.CopyFrom(
            pb.EngineTopology(**{k: v for k, v in entry["topology"].items() if v})
        )
    for rank in entry["ranks"]:
        r = status.ranks.add(
            rank=rank["rank"],
            inflight_requests=rank["inflight_requests"],
            queued_prefill_tokens=max(rank["queued_prefill_tokens"], 0),
            decode_blocks=max(rank["decode_blocks"], 0),
        )
        if rank["index_blocks"] is not None:
            r.index_blocks = rank["index_blocks"]
            r.index_share = rank["index_share"]
    return status


# --------------------------------------------------------------------------- Generate


class GrpcDownstream:
    """A ``Generate`` call as the :class:`~router.serving.downstream.Downstream` of a request.

    The head (status and headers) travels in the first chunk, with the first bytes.
    """

    __slots__ = ("_context", "_head", "headers")

    def __init__(self, context: aio.ServicerContext, headers: Mapping[str, str]) -> None:
        self._context = context
        self.headers = headers
        self._head: pb.GenerateChunk | None = None

    async def whole(self, status: int, headers: dict[str, str], body: bytes) -> None:
        await self._context.write(
            pb.GenerateChunk(status=status, headers=_headers(headers), data=body)
        )

    async def begin(self, status: int, headers: dict[str, str]) -> None:
        self._head = pb.GenerateChunk(status=status, headers=_headers(headers))

    async def write(self, chunk: bytes) -> None:
        head, self._head = self._head, None
        if head is not None:
            head.data = chunk
            await self._context.write(head)
        else:
            await self._context.write(pb.GenerateChunk(data=chunk))

    @property
    def peer(self) -> str | None:
        return self._context.peer()

    async def end(self) -> None:
        head, self._head = self._head, None
        if head is not None:
            await self._context.write(head)


# --------------------------------------------------------------------------- services


class RouterService(pb_grpc.RouterServicer):
    """kvroute.v1.Router."""

    def __init__(self, app: Services) -> None:
        self.app = app
        self.generations = Generations(app, Forwarder(app))

    # ------------------------------------------------------------------ Pick

    async def Pick(self, request: pb.PickRequest, context: aio.ServicerContext) -> pb.PickResponse:
        return await _call(self.app, "Pick", context, self._pick(request, context))

    def _admit(self, request_id: str, count_inflight: bool = True) -> None:
        """The checks the HTTP API makes before it reads a request (``count_inflight``:
        refuse at ``limits.max_inflight`` picks and requests in flight)."""
        if not REQUEST_ID.fullmatch(request_id):
            raise bad_request(
                f"request_id must be 1-128 printable ASCII characters, got {request_id[:40]!r}",
                "request_id",
            )
        self.app.gate.refuse_closed()
        if count_inflight:
            self.app.gate.refuse_full()

    async def _pick(self, request: pb.PickRequest, context: aio.ServicerContext) -> pb.PickResponse:
        app = self.app
        headers = _headers(request.headers)
        check_headers(headers)
        request_id = request.request_id or headers.get("x-request-id") or os.urandom(16).hex()
        self._admit(request_id)
        if app.picks.get(request_id) is not None:
            raise ApiError(409, f"a pick with request id {request_id!r} is open; release it first")
        # No wait: the caller forwards, and retries, itself.
        ticket = await app.gate.check(
            Entry(
                {**_metadata(context), **headers},
                request.body if request.WhichOneof("prompt") == "body" else b"",
                model=request.model,
                prompt_chars=len(request.text) if request.WhichOneof("prompt") == "text" else 0,
            )
        )
        subset = {endpoint_key(e) for e in request.subset} or None
        hints = {**_metadata(context), **headers}  # a gateway may send either
        session = request.session or app.decider.session_of(hints)
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise bad_request(
                "a prompt is required: text, token_ids, messages, block_keys or body", "prompt"
            )
        if kind == "block_keys":
            model = resolve_model(request.model or None, app.registry.models())
            route, load_tokens = self._keyed(request, request_id, model, session)
            app.decider.objectives(route, model, hints)
        else:
            payload = self._payload(request, kind)
            parse = parse_chat if "messages" in payload else parse_completion
            ready = await prepare(app, request_id, payload, parse, hints, session=session)
            model, route, load_tokens = ready.model, ready.route, ready.load_tokens
        route.flow = ticket
        try:
            plan = await app.decider.plan(model, route, load_tokens, subset)
        except NoCandidates:
            within = " within the requested subset" if subset else ""
            raise ApiError(
                503, f"no healthy engine serves model '{model}'{within}", retry_after=1
            ) from None
        try:
            app.picks.hold(plan)
        except DuplicatePick:
            raise ApiError(
                409, f"a pick with request id {request_id!r} is open; release it first"
            ) from None
        app.metrics.picks.labels("grpc", plan.mode).inc()
        roles = ("decode", "both") if plan.split is not None else ("both",)
        planner = app.decider.planner
        others = fallbacks(plan, lambda: planner.candidates(model, roles, subset=subset), 16)
        return pick_response(app, plan, others)

    def _payload(self, request: pb.PickRequest, kind: str) -> dict[str, Any]:
        """The prompt fields as the OpenAI body the HTTP API would have read."""
        if kind == "body":
            limit = self.app.config.limits.max_body_bytes
            if len(request.body) > limit:
                raise ApiError(413, f"request body is larger than {limit} bytes")
            body = decode_body(request.body, self.app.config.limits.max_json_depth)
            # The caller forwards this body itself: the router cannot take them out.
            self.app.owned.refuse(
                body, "remove them from the body (PickResponse.handoff says what to send)"
            )
            return body
        payload: dict[str, Any] = {}
        if kind == "text":
            payload["prompt"] = request.text
        elif kind == "token_ids":
            payload["prompt"] = list(request.token_ids.ids)
        else:
            payload["messages"] = [
                {"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
                for m in request.messages.messages
            ]
            if request.messages.HasField("add_generation_prompt"):
                payload["add_generation_prompt"] = request.messages.add_generation_prompt
        if request.model:
            payload["model"] = request.model
        if request.HasField("max_tokens"):
            payload["max_tokens"] = request.max_tokens
        if request.n:
            payload["n"] = request.n
        if request.cache_salt:
            payload["cache_salt"] = request.cache_salt
        return payload

    def _keyed(
        self, request: pb.PickRequest, request_id: str, model: str, session: str | None
    ) -> tuple[RouteRequest, int]:
        """Routing facts from precomputed block keys."""
        app = self.app
        bs = app.block_size_for(app.registry.base_of(model))
        keys = list(request.block_keys.keys)
        prompt_tokens = request.block_keys.prompt_tokens or len(keys) * bs
        if prompt_tokens < len(keys) * bs:
            raise bad_request(
                f"prompt_tokens ({prompt_tokens}) is shorter than {len(keys)} blocks of "
                f"{bs} tokens",
                "block_keys",
            )
        n = request.n or 1
        given = request.max_tokens if request.HasField("max_tokens") else None
        check_keyed(n, given, prompt_tokens, app.config.limits)
        max_tokens = app.config.limits.default_max_tokens if given is None else given
        route = RouteRequest(request_id, keys, prompt_tokens, bs, max_tokens * n, session=session)
        return route, prompt_tokens * n

    # ------------------------------------------------------------------ Release

    async def Release(
        self, request: pb.ReleaseRequest, context: aio.ServicerContext
    ) -> pb.ReleaseResponse:
        return await _call(self.app, "Release", context, self._release(request))

    async def _release(self, request: pb.ReleaseRequest) -> pb.ReleaseResponse:
        picks = self.app.picks
        lease = picks.get(request.request_id)
        if lease is None:
            raise ApiError(
                404, f"no open pick with request id {request.request_id!r} (released or expired)"
            )
        served = endpoint_key(request.served_endpoint) if request.served_endpoint else ""
        if served and served != lease.endpoint and self.app.registry.get(served) is not None:
            picks.move(lease, EngineKey(served, 0))
        if request.prefilled:
            picks.prefilled(lease)
            return pb.ReleaseResponse(held_s=picks.clock() - lease.opened_at)
        flow = lease.plan.route.flow
        if flow is not None:
            usage = {
                name: getattr(request, name)
                for name in ("prompt_tokens", "completion_tokens")
                if request.HasField(name)
            }
            self.app.gate.finish(flow, usage)
        return pb.ReleaseResponse(held_s=picks.end(lease, "released"))

    # ------------------------------------------------------------------ Generate

    async def Generate(self, request: pb.GenerateRequest, context: aio.ServicerContext) -> None:
        app = self.app
        started = time.perf_counter()
        outcome = Outcome()
        route = _ROUTES.get(request.endpoint, "")
        gate = app.gate
        permit = Permit()
        try:
            headers = {**_metadata(context), **_headers(request.headers)}
            check_headers(headers)
            request_id = request.request_id or headers.get("x-request-id") or os.urandom(16).hex()
            self._admit(request_id, count_inflight=False)
            deadline = gate.deadline()
            entry = Entry(headers, request.body, deadline=_caller_deadline(context))
            await gate.enter(entry, deadline, permit)  # the same queue as the HTTP API's
            outcome.ticket = permit.ticket
            limit = app.config.limits.max_body_bytes
            if len(request.body) > limit:
                raise ApiError(413, f"request body is larger than {limit} bytes")
            if not route:
                payload = decode_body(request.body, app.config.limits.max_json_depth)
                route = "chat" if "messages" in payload else "completions"
            path, parse = _GENERATIONS[route]
            await self.generations.serve(
                GrpcDownstream(context, headers),
                path,
                parse,
                request_id,
                request.body,
                started,
                outcome,
                deadline,
            )
        except ApiError as err:
            outcome.failed(err)
            code = status_code(err.status)
            app.metrics.grpc_requests.labels("Generate", code.name).inc()
            await context.abort(code, err.message)
        except asyncio.CancelledError:  # the caller cancelled: the engine's request is gone
            app.metrics.grpc_requests.labels("Generate", "CANCELLED").inc()
            raise
        except aio.AbortError:
            raise
        except Exception:  # a bug: log it, answer like the HTTP API's 503, never a trace
            log.exception("unexpected error serving Generate")
            outcome.set("engine_error", 503)
            app.metrics.grpc_requests.labels("Generate", "UNAVAILABLE").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the router failed to serve this call")
        else:
            app.metrics.grpc_requests.labels("Generate", "OK").inc()
        finally:
            gate.leave(permit, outcome.usage)
            app.metrics.requests.labels(
                route or "completions", outcome.outcome, outcome.status
            ).inc()
            app.metrics.request_seconds.observe(time.perf_counter() - started)


class AdminService(pb_grpc.AdminServicer):
    """kvroute.v1.Admin: the engines at run time (the same layer as /admin/engines)."""

    def __init__(self, app: Services) -> None:
        self.app = app

    async def _admin(self, method: str, context: aio.ServicerContext, work: Any) -> pb.EngineStatus:
        async def run() -> pb.EngineStatus:
            self.app.admin.authorize(
                _metadata(context).get("authorization"), context.peer(), "grpc"
            )
            return _engine_status(await work())

        return await _call(self.app, method, context, run())

    async def ListEngines(
        self, request: pb.ListEnginesRequest, context: aio.ServicerContext
    ) -> pb.ListEnginesResponse:
        async def run() -> pb.ListEnginesResponse:
            self.app.admin.authorize(
                _metadata(context).get("authorization"), context.peer(), "grpc"
            )
            entries = await self.app.admin.engines()
            return pb.ListEnginesResponse(engines=[_engine_status(e) for e in entries])

        return await _call(self.app, "ListEngines", context, run())

    async def AddEngine(
        self, request: pb.AddEngineRequest, context: aio.ServicerContext
    ) -> pb.EngineStatus:
        entry: dict[str, Any] = {"url": request.url}
        if request.role:
            entry["role"] = request.role
        if request.models:
            entry["models"] = list(request.models)
        if request.dp_size:
            entry["dp_size"] = request.dp_size
        if request.HasField("bootstrap_port"):
            entry["bootstrap_port"] = request.bootstrap_port
        if request.kv_events in ("auto", "none"):
            entry["kv_events"] = request.kv_events
        elif request.kv_events:
            entry["kv_events"] = {
                "endpoint": request.kv_events,
                "replay_endpoint": request.kv_events_replay or None,
                "topic": request.kv_events_topic,
            }
        if request.HasField("topology"):
            where = request.topology
            entry["topology"] = {
                name: value
                for name, value in (
                    ("node", where.node),
                    ("rack", where.rack),
                    ("zone", where.zone),
                )
                if value
            }
        return await self._admin("AddEngine", context, lambda: self.app.admin.add_engine(entry))

    async def RemoveEngine(
        self, request: pb.EngineRef, context: aio.ServicerContext
    ) -> pb.EngineStatus:
        return await self._admin(
            "RemoveEngine", context, lambda: self.app.admin.remove_engine(request.endpoint)
        )

    async def DrainEngine(
        self, request: pb.EngineRef, context: aio.ServicerContext
    ) -> pb.EngineStatus:
        return await self._admin(
            "DrainEngine", context, lambda: self.app.admin.drain(request.endpoint)
        )

    async def UndrainEngine(
        self, request: pb.EngineRef, context: aio.ServicerContext
    ) -> pb.EngineStatus:
        return await self._admin(
            "UndrainEngine", context, lambda: self.app.admin.undrain(request.endpoint)
        )

    async def Reload(
        self, request: pb.ReloadRequest, context: aio.ServicerContext
    ) -> pb.ReloadResponse:
        async def run() -> pb.ReloadResponse:
            self.app.admin.authorize(
                _metadata(context).get("authorization"), context.peer(), "grpc"
            )
            result = await self.app.admin.reload()
            return pb.ReloadResponse(applied=result["applied"], restart=result["restart"])

        return await _call(self.app, "Reload", context, run())
