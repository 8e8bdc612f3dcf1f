"""The emulator's HTTP API: vLLM's OpenAI-compatible endpoints over the engine model.

A client that disconnects before its answer is complete has its requests aborted in
the engine model, which frees their blocks at once (streaming or not).

Faults (``faults.py``) act here: a request may be answered 500 at once, delayed, or
its answer stalled or cut after some tokens; ``/admin/faults`` reads and changes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import uuid
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from router import __version__
from router.emulator.generation import Generation, sse
from router.emulator.handoff.base import HandoffFailed
from router.emulator.messages import routes as messages_routes
from router.emulator.pooling import routes as pooling_routes
from router.emulator.protocol import (
    APIError,
    chat_prompt,
    check_token_ids,
    encode_json,
    error_body,
    parse_body,
    render_result,
)
from router.emulator.responses_api import responses_routes
from router.emulator.state import EmulatorState
from router.emulator.tokens import routes as tokens_routes
from router.tokenization.words import VOCAB_SIZE

log = logging.getLogger(__name__)

_JSON = "application/json"
#: What uvicorn logs when an application returns mid-response, as an injected drop does.
_INCOMPLETE = "ASGI callable returned without completing response."


class _InjectedDropFilter(logging.Filter):
    """Keeps uvicorn's complaint about an incomplete response out of the logs: the
    emulator leaves a response incomplete only to inject a dropped connection, which
    it logs itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _INCOMPLETE


def quiet_injected_drops() -> None:
    """Install the filter on uvicorn's error logger (once)."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _InjectedDropFilter) for f in logger.filters):
        logger.addFilter(_InjectedDropFilter())


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(encode_json(body), status_code=status, media_type=_JSON, headers=headers)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _raw_headers(headers: dict[str, str], content_type: str) -> list[tuple[bytes, bytes]]:
    raw = [(b"content-type", content_type.encode("latin-1"))]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    return raw


GARBLE = b"\x00\xffHTTP/1.1 200 OK not server-sent events\r\n\r\n"
"""What a garbled stream sends instead of its next event (``garble_after_tokens``)."""


class _Dropped(Response):
    """A response whose connection closes after the headers and half of ``body``."""

    def __init__(self, body: bytes, headers: dict[str, str]) -> None:
        super().__init__()
        self._body = body
        self._headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = _raw_headers(self._headers, _JSON)
        raw.append((b"content-length", str(len(self._body)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": raw})
        half = self._body[: len(self._body) // 2]
        await send({"type": "http.response.body", "body": half, "more_body": True})
        # Returning now leaves the response incomplete: the server closes the connection.


class _EventStream(Response):
    """A streamed answer (server-sent events) with the faults in force when it began.

    As vLLM's, the status and headers go out at once, before the engine (or a KV
    handoff) has done anything: a streamed answer carries no ``x-kvroute-handoff``, and
    a failed handoff shows as an error event. The client's disconnect is watched from
    the start (even before the first token), so an abandoned request is aborted at once.
    """

    def __init__(
        self,
        state: EmulatorState,
        gen: Generation,
        stall_after: int | None,
        drop_after: int | None,
        garble_after: int | None = None,
    ) -> None:
        super().__init__()
        self._state = state
        self._gen = gen
        self._stall_after = stall_after
        self._drop_after = drop_after
        self._garble_after = garble_after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.ensure_future(self._pump(send))
        watching = asyncio.ensure_future(_wait_disconnect(receive))
        client_gone = False
        try:
            await asyncio.wait({streaming, watching}, return_when=asyncio.FIRST_COMPLETED)
            client_gone = not streaming.done()
            for task in (streaming, watching):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            if not streaming.cancelled():
                streaming.result()
        finally:
            self._gen.close(client_gone)

    async def _pump(self, send: Send) -> None:
        gen = self._gen
        headers = _raw_headers(gen.headers(), "text/event-stream; charset=utf-8")
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            await gen.start()
        except HandoffFailed as exc:
            # As vLLM reports a failed KV load on a stream: an error event, then [DONE].
            body = sse(error_body(500, exc.message)) + b"data: [DONE]\n\n"
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        sent = 0
        async for chunk, tokens in gen.events():
            if self._stall_after is not None and sent + tokens > self._stall_after:
                self._state.metrics.fault_injected("stall")
                log.info("%s: stalled after %d tokens (injected)", gen.response_id, sent)
                await asyncio.Future()  # until the client leaves
            if self._drop_after is not None and sent + tokens > self._drop_after:
                self._state.metrics.fault_injected("drop")
                log.info("%s: dropped after %d tokens (injected)", gen.response_id, sent)
                return  # incomplete: the server closes the connection
            if self._garble_after is not None and sent + tokens > self._garble_after:
                self._state.metrics.fault_injected("garble")
                log.info("%s: garbled after %d tokens (injected)", gen.response_id, sent)
                await send({"type": "http.response.body", "body": GARBLE, "more_body": False})
                return
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            sent += tokens
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def build_app(state: EmulatorState) -> Starlette:
    """The Starlette application serving ``state``."""
    cfg = state.config
    tokenizer = state.tokenizer

    def request_id(request: Request) -> str:
        return request.headers.get("x-request-id") or uuid.uuid4().hex

    async def generate(
        request: Request,
        chat: bool,
        body: dict[str, Any] | None = None,
        make: type[Generation] = Generation,
    ) -> Response:
        """A completion or chat (``chat``); ``body`` and ``make``: another API's request
        as its chat body, and the generation answering in that API's shapes."""
        faults = state.faults
        if faults.fails_now(state.rng):
            state.metrics.fault_injected("fail_rate")
            return _json(error_body(500, "injected failure (fail_rate)"), 500)
        if faults.extra_latency_ms:
            state.metrics.fault_injected("extra_latency")
            await asyncio.sleep(faults.extra_latency_ms / 1000)
        # Read now: changing the faults does not touch requests already in flight.
        stall_after, drop_after = faults.stall_after_tokens, faults.drop_after_tokens
        garble_after = faults.garble_after_tokens
        base_id = request_id(request)
        if body is None:
            body = parse_body(await request.body())
        req = state.parse(body, chat)
        gen = make(state, state.pick_rank(request.headers, body), req, base_id, chat)
        if req.stream:
            return _EventStream(state, gen, stall_after, drop_after, garble_after)

        async def answer() -> dict[str, Any]:
            await gen.start()
            return await gen.collect()

        answering = asyncio.ensure_future(answer())
        watching = asyncio.ensure_future(_wait_disconnect(request.receive))
        await asyncio.wait({answering, watching}, return_when=asyncio.FIRST_COMPLETED)
        if not answering.done():
            answering.cancel()
            with contextlib.suppress(asyncio.CancelledError, HandoffFailed):
                await answering
            gen.close(client_gone=True)
            # The client is gone; this status only reaches logs.
            return Response(status_code=499)
        watching.cancel()
        try:
            body = answering.result()
        except HandoffFailed as exc:
            gen.close(client_gone=False)
            return _json(error_body(500, exc.message), 500, gen.headers())
        gen.close(client_gone=False)
        if stall_after is not None and gen.num_tokens > stall_after:
            state.metrics.fault_injected("stall")
            await _wait_disconnect(request.receive)
            return Response(status_code=499)
        if drop_after is not None and gen.num_tokens > drop_after:
            state.metrics.fault_injected("drop")
            return _Dropped(encode_json(body), gen.headers())
        if garble_after is not None and gen.num_tokens > garble_after:
            state.metrics.fault_injected("garble")
            whole = encode_json(body)
            return Response(whole[: len(whole) // 2], 200, gen.headers(), _JSON)
        return _json(body, headers=gen.headers())

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def render_completions(request: Request) -> Response:
        req = state.parse(parse_body(await request.body()), chat=False)
        base = request_id(request)
        return _json(
            [render_result(f"cmpl-{base}-{i}", ids, req) for i, ids in enumerate(req.prompts)]
        )

    async def render_chat(request: Request) -> Response:
        req = state.parse(parse_body(await request.body()), chat=True)
        return _json(render_result(f"chatcmpl-{request_id(request)}", req.prompts[0], req))

    async def tokenize(request: Request) -> Response:
        body = parse_body(await request.body())
        state.models.resolve(body.get("model"))
        if "messages" in body:
            ids, _ = chat_prompt(body, tokenizer, cfg.mm_placeholder_tokens)
        elif isinstance(body.get("prompt"), str):
            ids = tokenizer.encode(body["prompt"])
        else:
            raise APIError(400, "`prompt` (a string) or `messages` is required", "prompt")
        strs = [tokenizer.token_str(t) for t in ids] if body.get("return_token_strs") else None
        return _json(
            {
                "count": len(ids),
                "max_model_len": cfg.params.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(request: Request) -> Response:
        body = parse_body(await request.body())
        state.models.resolve(body.get("model"))
        ids = check_token_ids(body.get("tokens"), "tokens")
        return _json({"prompt": tokenizer.decode(ids)})

    async def models(request: Request) -> Response:
        def card(name: str, parent: str | None) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": state.created,
                "owned_by": "vllm",
                "root": name,
                "parent": parent,
                "max_model_len": cfg.params.max_model_len,
                "permission": [],
            }

        cards = [card(cfg.model, None)] + [card(n, cfg.model) for n in cfg.lora_modules]
        return _json({"object": "list", "data": cards})

    async def health(request: Request) -> Response:
        if state.faults.fail_health:
            return _json(error_body(503, "injected failure (fail_health)"), 503)
        return Response(status_code=200)

    async def admin_faults(request: Request) -> Response:
        faults = state.faults
        if request.method == "DELETE":
            faults.clear()
        elif request.method == "POST":
            try:
                faults.update(parse_body(await request.body()))
            except ValueError as exc:
                raise APIError(400, str(exc)) from None
        return _json(faults.as_dict())

    async def server_info(request: Request) -> Response:
        return _json(state.server_info)

    async def kv_event_sources(request: Request) -> Response:
        return _json(state.kv_event_sources)

    async def model_info(request: Request) -> Response:
        p = cfg.params
        return _json(
            {
                "model": cfg.model,
                "tokenizer": "kvroute-words",
                "vocab_size": VOCAB_SIZE,
                "max_model_len": p.max_model_len,
                "block_size": p.block_size,
                "is_generation": True,
                "lora_modules": list(cfg.lora_modules),
            }
        )

    async def version(request: Request) -> Response:
        return _json({"version": __version__})

    async def reset_prefix_cache(request: Request) -> Response:
        refused = [i for i, d in enumerate(state.drivers) if not d.reset_prefix_cache()]
        if refused:
            raise APIError(409, "prefix cache not reset: requests in flight hold blocks")
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return _json(exc.body(), exc.status)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _json(error_body(exc.status_code, str(exc.detail)), exc.status_code)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions/render", render_completions, methods=["POST"]),
        Route("/v1/chat/completions/render", render_chat, methods=["POST"]),
        *responses_routes(state),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        *pooling_routes(state),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/kv_event_sources", kv_event_sources, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/admin/faults", admin_faults, methods=["GET", "POST", "DELETE"]),
        *messages_routes(state, generate),
        *tokens_routes(generate),
    ]
    app = Starlette(
        routes=routes, exception_handlers={APIError: api_error, HTTPException: http_error}
    )
    if cfg.api_key:
        return _ApiKey(app, cfg.api_key)  # type: ignore[return-value]
    return app


class _ApiKey:
    """vLLM's ``--api-key``: /v1/* needs ``Authorization: Bearer KEY`` (else 401)."""

    def __init__(self, app: Starlette, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                body = b'{"error":"Unauthorized"}'
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
