"""Envoy ext_proc endpoint picker: the Gateway API Inference Extension protocol.

A gateway (Envoy, kgateway, Istio, llm-d) streams each request to this server and
forwards it itself to the endpoint it is told. One ``Process`` stream is one HTTP
request; in ``FULL_DUPLEX_STREAMED`` body mode the messages are:

1. request headers (``end_of_stream`` false): remembered, not answered yet;
2. request body chunks: buffered until the one with ``end_of_stream``; then the
   request is decided exactly as the HTTP API decides it (:mod:`router.serving.decide`)
   and the answer goes out: the request-headers response with the header
   ``x-gateway-destination-endpoint: ip:port`` (an ordered, comma-separated fallback
   list with ``extproc.fallbacks``), the same value in dynamic metadata
   ``envoy.lb`` / ``x-gateway-destination-endpoint``, ``clear_route_cache``, and for a
   split what the plan's handoff dialect asks for
   (:meth:`~router.handoff.base.Handoff.directions`: ``x-prefiller-host-port``, so the
   llm-d decode sidecar runs the prefill leg);
   then every body chunk echoed back as a ``StreamedBodyResponse`` (at most 62,000
   bytes each), the last with ``end_of_stream``; a body carrying the router's own
   handoff fields (:mod:`router.handoff.fields`) is echoed without them;
3. response headers: the endpoint the gateway used, from
   ``metadata_context["envoy.lb"]["x-gateway-destination-endpoint-served"]``, takes the
   request's load if it is another than the chosen one; answered with ``x-kvroute-*``
   headers for the client;
4. response body chunks, echoed (the first marks the prefill done); the last, or the
   response trailers, or the end of the stream, releases the request's load.

A subset hint in ``filter_metadata["envoy.lb.subset_hint"]
["x-gateway-destination-endpoint-subset"]`` (a list, or a comma-separated string, of
``ip:port`` or bare ``ip``) limits the choice; an empty hint or one naming no eligible
engine gets 503. Refusals are ``ImmediateResponse``: 503 with no ready engine (or while
draining), 429 when shedding (``limits.max_inflight``), 400/404/413 for a request the
HTTP API would refuse, with OpenAI error JSON.

In ``BUFFERED`` or ``STREAMED`` body mode (as the gateway's ``protocol_config`` says)
headers are answered at once and the routing goes in the last body chunk's response;
with body mode ``NONE`` or a body-less request the engine is chosen by load alone.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import msgspec
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import json_format, struct_pb2
from grpc import aio

from router.flow.ticket import FlowTicket
from router.frontends.grpc.api import fallbacks
from router.handoff import base
from router.handoff import registry as dialects
from router.plan import Plan
from router.policy.base import Decision, NoCandidates
from router.serving.errors import ApiError
from router.serving.gate import Entry
from router.serving.headers import REQUEST_ID, check_single
from router.serving.intake import prepare
from router.serving.parsing import decode_body, parse_chat, parse_completion
from router.serving.picks import Lease
from router.types import EngineKey

if TYPE_CHECKING:
    from router.serving.services import Services

log = logging.getLogger("kvroute.extproc")
_encode = msgspec.json.Encoder().encode

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
FLOW_NAMESPACE = "kvroute.flow"
"""Dynamic metadata a gateway may set for flow control: ``priority``, ``tenant``."""
DESTINATION = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"
SERVED = "x-gateway-destination-endpoint-served"
PREFILLER = base.PREFILLER
#: Some gateways cap a streamed body chunk at 64 KiB; stay under it (as llm-d does).
CHUNK_LIMIT = 62_000

_Mode = processing_mode_pb2.ProcessingMode
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
    )


def immediate(err: ApiError) -> ep.ProcessingResponse:
    """A refusal the gateway sends to the client instead of forwarding."""
    headers = [_header("content-type", "application/json")]
    if err.retry_after is not None:
        headers.append(_header("retry-after", str(max(int(err.retry_after), 1))))
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=err.status),  # type: ignore[arg-type]
            headers=ep.HeaderMutation(set_headers=headers),
            body=err.body(),
            details=f"kvroute: {err.message}",
        )
    )


def _echo(chunks: list[bytes], ended: bool, request: bool) -> Iterator[ep.ProcessingResponse]:
    """Body chunks sent back unchanged (FULL_DUPLEX_STREAMED must return every byte)."""
    pieces = [c[i : i + CHUNK_LIMIT] for c in chunks for i in range(0, len(c), CHUNK_LIMIT)]
    if not pieces:
        pieces = [b""]
    for i, piece in enumerate(pieces):
        streamed = ep.StreamedBodyResponse(body=piece, end_of_stream=ended and i == len(pieces) - 1)
        body = ep.BodyResponse(
            response=ep.CommonResponse(body_mutation=ep.BodyMutation(streamed_response=streamed))
        )
        yield (
            ep.ProcessingResponse(request_body=body)
            if request
            else ep.ProcessingResponse(response_body=body)
        )


USAGE_TAIL = 8_192
"""Bytes of an answer's end kept to find its usage (the last SSE event, or a JSON body's
``usage`` object, which engines put last)."""
_USAGE_FIELD = re.compile(
    rb'"(prompt_tokens|input_tokens|completion_tokens|output_tokens)"\s*:\s*(\d{1,12})'
)


def usage_in(tail: bytes) -> dict[str, int] | None:
    """The token counts of the last usage object in an answer's ``tail`` (OpenAI's or
    Anthropic's names); None if it has none. A quoted key cannot occur inside generated
    text (its quotes would be escaped), so a plain scan is enough."""
    found = {name.decode(): int(value) for name, value in _USAGE_FIELD.findall(tail)}
    return found or None


class ExtProcService(ep_grpc.ExternalProcessorServicer):
    """``envoy.service.ext_proc.v3.ExternalProcessor`` bound to one router."""

    def __init__(self, app: Services) -> None:
        self.app = app

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: aio.ServicerContext
    ) -> AsyncIterator[ep.ProcessingResponse]:
        exchange = Exchange(self.app)
        try:
            async for message in request_iterator:
                for response in await exchange.on(message):
                    yield response
                if exchange.finished:
                    return
        finally:
            exchange.close()


class Exchange:
    """One request's ext_proc stream: its state from headers to the end of the response."""

    def __init__(self, app: Services) -> None:
        self.app = app
        self.request_mode: int = _Mode.FULL_DUPLEX_STREAMED
        self.response_mode: int = _Mode.FULL_DUPLEX_STREAMED
        self.headers: dict[str, str] = {}
        self.metadata: dict[str, Any] = {}
        self.chunks: list[bytes] = []
        self.size = 0
        self.request_id = ""
        self.routed = False
        self.finished = False
        self.lease: Lease | None = None
        self.ticket: FlowTicket | None = None
        self.tail = bytearray()
        """The answer's last bytes (flow control on): its usage corrects the ticket's
        token estimate."""
        self.summary: dict[str, str] = {}
        self.rewritten = False
        """The body lost router-owned fields: the gateway must forward the new one."""

    # ------------------------------------------------------------------ dispatch

    async def on(self, message: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        if message.HasField("protocol_config"):
            self.request_mode = message.protocol_config.request_body_mode
            self.response_mode = message.protocol_config.response_body_mode
        if message.HasField("metadata_context"):
            for namespace, value in message.metadata_context.filter_metadata.items():
                self.metadata[namespace] = json_format.MessageToDict(value)
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(message.request_headers)
        if kind == "request_body":
            return await self._request_body(message.request_body)
        if kind == "request_trailers":
            out = [] if self.routed else await self._route(ended=False)
            if not self.finished:
                out.append(ep.ProcessingResponse(request_trailers=ep.TrailersResponse()))
            return out
        if kind == "response_headers":
            return self._response_headers(message.response_headers)
        if kind == "response_body":
            return self._response_body(message.response_body)
        if kind == "response_trailers":
            self._release()
            return [ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]
        return []

    @property
    def _duplex(self) -> bool:
        return self.request_mode == _Mode.FULL_DUPLEX_STREAMED

    # ------------------------------------------------------------------ request

    async def _request_headers(self, message: ep.HttpHeaders) -> list[ep.ProcessingResponse]:
        for h in message.headers.headers:
            self.headers[h.key.lower()] = h.raw_value.decode("utf-8", "replace") or h.value
        given = self.headers.get("x-request-id", "")
        self.request_id = given if REQUEST_ID.fullmatch(given) else os.urandom(16).hex()
        try:
            check_single(h.key.lower() for h in message.headers.headers)
        except ApiError as err:
            return self._refuse(err)
        if message.end_of_stream or self.request_mode == _Mode.NONE:
            return await self._route(ended=message.end_of_stream)
        if self._duplex:
            return []  # answered once the whole body is here
        return [ep.ProcessingResponse(request_headers=ep.HeadersResponse())]

    async def _request_body(self, message: ep.HttpBody) -> list[ep.ProcessingResponse]:
        if self.routed:  # body mode NONE routed at the headers; pass anything on
            return list(_echo([message.body], message.end_of_stream, request=True))
        self.chunks.append(message.body)
        self.size += len(message.body)
        limit = self.app.config.limits.max_body_bytes
        if self.size > limit:
            return self._refuse(ApiError(413, f"request body is larger than {limit} bytes"))
        if not message.end_of_stream:
            if self._duplex:
                return []
            return [ep.ProcessingResponse(request_body=ep.BodyResponse())]
        return await self._route(ended=True)

    def _refuse(self, err: ApiError) -> list[ep.ProcessingResponse]:
        self.finished = True
        outcome = {429: "rejected", 503: "no_engine"}.get(err.status, "client_error")
        self.app.metrics.extproc_requests.labels(outcome, str(err.status)).inc()
        log.debug("request %s refused: %s %s", self.request_id, err.status, err.message)
        return [immediate(err)]

    async def _route(self, ended: bool) -> list[ep.ProcessingResponse]:
        """Decide, then answer the request headers (and echo the body, in duplex mode)."""
        try:
            mutation, metadata = await self._decide()
        except ApiError as err:
            return self._refuse(err)
        except Exception:  # a bug: log it, refuse like the HTTP API's 503, never a trace
            log.exception("request %s: unexpected error while routing", self.request_id)
            return self._refuse(ApiError(503, "the router failed to route this request"))
        self.routed = True
        self.app.metrics.extproc_requests.labels("routed", "200").inc()
        common = ep.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        has_body = bool(self.chunks)
        if not has_body or self._duplex:
            out = [
                ep.ProcessingResponse(
                    request_headers=ep.HeadersResponse(response=common), dynamic_metadata=metadata
                )
            ]
            if has_body:
                out.extend(_echo(self.chunks, ended, request=True))
        else:  # buffered or streamed: the headers went on already; route in the body answer
            if self.rewritten:
                common.body_mutation.body = self.chunks[0]
            out = [
                ep.ProcessingResponse(
                    request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata
                )
            ]
        self.chunks = []
        return out

    def _subset(self) -> set[str] | None:
        """Engines the gateway allows (``host:port``), or None without a hint."""
        hint = self.metadata.get(SUBSET_NAMESPACE)
        if not isinstance(hint, dict) or SUBSET not in hint:
            return None
        value = hint[SUBSET]
        items = value if isinstance(value, list) else [value]
        named = {p.strip() for item in items if isinstance(item, str) for p in item.split(",")}
        named.discard("")
        hosts = {n for n in named if ":" not in n}  # a bare address: any of its ports
        return {
            e.endpoint
            for e in self.app.registry
            if e.endpoint in named or e.endpoint.rpartition(":")[0] in hosts
        }

    def _kind(self, body: bytes) -> tuple[str | None, dict[str, Any] | None]:
        """Chat or completion, from the path (or the body on other paths)."""
        path = self.headers.get(":path", "").split("?", 1)[0]
        depth = self.app.config.limits.max_json_depth
        if path.endswith("/chat/completions"):
            return "chat", decode_body(body, depth)
        if path.endswith("/completions"):
            return "completions", decode_body(body, depth)
        try:
            payload = decode_body(body, depth) if body else None
        except ApiError:
            if self._json_body() and not self.app.owned.trusted:
                # An engine's laxer parser (NaN, deeper nesting) could still find
                # router-owned fields in a JSON body the router cannot read.
                raise
            return None, None
        if payload is not None and "messages" in payload:
            return "chat", payload
        if payload is not None and "prompt" in payload:
            return "completions", payload
        return None, payload

    def _json_body(self) -> bool:
        """Whether the engine reads the body as JSON (vLLM's routes do unless it is sent
        as a form: no ``content-type``, or a JSON one)."""
        kind = self.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        return not kind or kind == "application/json" or kind.endswith("+json")

    def _strip_owned(self, payload: dict[str, Any], body: bytes) -> bytes:
        """The body without router-owned handoff fields; the gateway is sent the new one."""
        owned = self.app.owned
        if not self._duplex and len(self.chunks) > 1:
            # STREAMED mode: the earlier chunks went on unchanged already.
            owned.refuse(payload)
            return body
        if not owned.strip(payload):
            return body
        body = _encode(payload)
        self.chunks = [body]
        self.rewritten = True
        return body

    async def _decide(self) -> tuple[ep.HeaderMutation, struct_pb2.Struct]:
        app = self.app
        app.gate.refuse_closed()
        app.gate.refuse_full()
        body = b"".join(self.chunks)
        meta = self.metadata.get(FLOW_NAMESPACE)
        # No wait: Envoy bounds each answer (message_timeout).
        self.ticket = await app.gate.check(
            Entry(self.headers, body, metadata=meta if isinstance(meta, dict) else None)
        )
        subset = self._subset()
        if subset is not None and not subset:
            raise ApiError(503, "no eligible endpoint in the gateway's subset hint", retry_after=1)
        kind, payload = self._kind(body)
        if payload is not None:
            body = self._strip_owned(payload, body)
        decode: Decision
        plan: Plan | None = None
        try:
            if kind is None or payload is None:
                decode = await app.decider.plan_on_load(self.request_id, subset)
            else:
                parse = parse_chat if kind == "chat" else parse_completion
                ready = await prepare(
                    app, self.request_id, payload, parse, self.headers, flow=self.ticket
                )
                plan = await app.decider.plan(ready.model, ready.route, ready.load_tokens, subset)
                decode = plan.decode
        except NoCandidates:
            within = " in the gateway's subset" if subset is not None else ""
            raise ApiError(503, f"no ready engine{within}", retry_after=1) from None
        destination = decode.engine.endpoint
        limit = app.config.extproc.fallbacks
        if plan is not None and limit:
            roles = ("decode", "both") if plan.split is not None else ("both",)
            planner, model = app.decider.planner, plan.model
            pool = lambda: planner.candidates(model, roles, subset=subset)  # noqa: E731
            destination = ",".join([destination, *fallbacks(plan, pool, limit)])
        set_headers = [_header(DESTINATION, destination)]
        remove = []
        if body:
            set_headers.append(_header("content-length", str(len(body))))
        if "x-request-id" not in self.headers:
            set_headers.append(_header("x-request-id", self.request_id))
        engine = app.registry.engine_of(decode.engine)
        if engine is not None and engine.dp_size > 1:
            set_headers.append(_header("x-data-parallel-rank", str(decode.engine.rank)))
        mode = "aggregated"
        if plan is not None:
            mode = plan.mode
            if plan.prefill is not None and plan.dialect is not None:
                prefill = app.registry.engine_of(plan.prefill.engine)
                directions = dialects.get(plan.dialect).directions(plan, prefill)
                set_headers.extend(_header(k, v) for k, v in directions.headers.items())
            self.lease = app.picks.hold(plan, register=False)
            app.metrics.picks.labels("extproc", mode).inc()
        if plan is None or plan.prefill is None:
            remove.append(PREFILLER)  # a client must not steer the decode sidecar
        self.summary = {
            "x-kvroute-engine": decode.engine.label,
            "x-kvroute-reason": decode.summary()
            + (f"; {self.ticket.describe()}" if self.ticket is not None else ""),
            "x-kvroute-mode": mode,
            "x-request-id": self.request_id,
        }
        if plan is not None and plan.prefill is not None:
            self.summary["x-kvroute-prefill"] = plan.prefill.engine.label
        metadata = struct_pb2.Struct()
        metadata.update({LB_NAMESPACE: {DESTINATION: destination}})
        return ep.HeaderMutation(set_headers=set_headers, remove_headers=remove), metadata

    # ------------------------------------------------------------------ response

    def _response_headers(self, message: ep.HttpHeaders) -> list[ep.ProcessingResponse]:
        lb = self.metadata.get(LB_NAMESPACE)
        served = lb.get(SERVED) if isinstance(lb, dict) else None
        if self.lease is not None and isinstance(served, str) and served:
            served = served.split(",", 1)[0].strip()
            if served != self.lease.endpoint and self.app.registry.get(served) is not None:
                self.app.picks.move(self.lease, EngineKey(served, 0))
                self.summary["x-kvroute-engine"] = served
        if message.end_of_stream:
            self._release()
        mutation = ep.HeaderMutation(set_headers=[_header(k, v) for k, v in self.summary.items()])
        return [
            ep.ProcessingResponse(
                response_headers=ep.HeadersResponse(
                    response=ep.CommonResponse(header_mutation=mutation)
                )
            )
        ]

    def _response_body(self, message: ep.HttpBody) -> list[ep.ProcessingResponse]:
        lease = self.lease
        if lease is not None and not lease.ended and not lease.decode.prefilled:
            self.app.picks.prefilled(lease)
        if self.ticket is not None and not self.ticket.finished:
            tail = self.tail
            tail += message.body
            if len(tail) > 2 * USAGE_TAIL:  # trimmed now and then, not at every chunk
                del tail[:-USAGE_TAIL]
            if message.end_of_stream:
                self._finish(usage_in(bytes(tail[-USAGE_TAIL:])))
        if message.end_of_stream:
            self._release()
        if self.response_mode == _Mode.FULL_DUPLEX_STREAMED:
            return list(_echo([message.body], message.end_of_stream, request=False))
        return [ep.ProcessingResponse(response_body=ep.BodyResponse())]

    def _release(self) -> None:
        if self.lease is not None and not self.lease.ended:
            self.app.picks.end(self.lease, "stream_end")

    def _finish(self, usage: dict[str, int] | None) -> None:
        self.app.gate.finish(self.ticket, usage)

    def close(self) -> None:
        """The stream ended (normally, or the gateway reset it): release what is held."""
        self._release()
        self._finish(None)  # no answer seen to its end: the estimate stands
