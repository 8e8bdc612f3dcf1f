"""The emulator's HTTP API: vLLM's OpenAI-compatible endpoints over the engine model.

A client that disconnects before its answer is complete has its requests aborted in
the engine model, which frees their blocks at once (streaming or not).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from router import __version__
from router.emulator.config import EmulatorConfig
from router.emulator.driver import EngineDriver
from router.emulator.metrics import EngineMetrics
from router.emulator.protocol import (
    APIError,
    GenerationRequest,
    ServedModels,
    chat_chunk,
    chat_prompt,
    chat_response,
    check_token_ids,
    completion_chunk,
    completion_response,
    encode_json,
    error_body,
    parse_body,
    parse_generation,
    render_result,
    usage,
    usage_chunk,
)
from router.engine_model import RequestOutput, RequestSpec
from router.tokenization.words import VOCAB_SIZE, WordTokenizer

_JSON = "application/json"


@dataclass
class EmulatorState:
    """What the handlers share: settings, the engine ranks and what was bound."""

    config: EmulatorConfig
    drivers: list[EngineDriver]
    metrics: EngineMetrics
    #: ``/server_info`` body, filled in once the sockets are bound.
    server_info: dict[str, Any]
    tokenizer: WordTokenizer = field(default_factory=WordTokenizer)
    created: int = field(default_factory=lambda: int(time.time()))
    serial: itertools.count[int] = field(default_factory=itertools.count)
    models: ServedModels = field(init=False)

    def __post_init__(self) -> None:
        cfg = self.config
        self.models = ServedModels(cfg.model, {n: i + 1 for i, n in enumerate(cfg.lora_modules)})

    def parse(self, body: dict[str, Any], chat: bool) -> GenerationRequest:
        """Validate a generation body, including that each prompt fits the engine."""
        req = parse_generation(
            body, chat, self.models, self.tokenizer, self.config.default_max_tokens
        )
        model = self.drivers[0].model
        for ids in req.prompts:
            try:
                model.validate(len(ids), req.max_tokens)
            except ValueError as exc:
                raise APIError(400, str(exc), "messages" if chat else "prompt") from None
        return req


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(encode_json(body), status_code=status, media_type=_JSON, headers=headers)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """Server-sent events from an async iterator; ``on_close`` runs however it ends.

    The client's disconnect is watched while streaming (even before the first event),
    so an abandoned request is aborted without waiting for its next token.
    """

    def __init__(
        self, events: AsyncIterator[bytes], on_close: Callable[[], None], headers: dict[str, str]
    ) -> None:
        super().__init__(events, headers=headers, media_type="text/event-stream")
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        streaming = asyncio.ensure_future(self._pump(send))
        watching = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({streaming, watching}, return_when=asyncio.FIRST_COMPLETED)
            for task in (streaming, watching):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            if not streaming.cancelled():
                streaming.result()
        finally:
            self._on_close()

    async def _pump(self, send: Send) -> None:
        async for chunk in self._events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _sse(body: dict[str, Any]) -> bytes:
    return b"data: " + encode_json(body) + b"\n\n"


class _Generation:
    """One completion or chat request fanned out to the engine: one sequence per choice."""

    def __init__(self, state: EmulatorState, req: GenerationRequest, base_id: str, chat: bool):
        self.state = state
        self.req = req
        self.chat = chat
        self.response_id = f"{'chatcmpl' if chat else 'cmpl'}-{base_id}"
        self.created = int(time.time())
        self.driver = state.drivers[0]
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        serial = next(state.serial)
        self.specs = [
            RequestSpec(
                request_id=f"{base_id}-{serial}-{p}-{j}",
                prompt_token_ids=ids,
                max_tokens=req.max_tokens,
                lora_name=req.lora_name,
                lora_id=req.lora_id,
                cache_salt=req.cache_salt,
                sample_seed=req.seed + j,
            )
            for p, ids in enumerate(req.prompts)
            for j in range(req.n)
        ]
        self.cached = [0] * len(self.specs)
        self.counts = [0] * len(self.specs)

    def submit(self) -> None:
        for i, spec in enumerate(self.specs):
            self.driver.submit(spec, (self.queue, i))

    def abort(self) -> None:
        for spec in self.specs:
            self.driver.abort(spec.request_id)

    def usage(self) -> dict[str, Any]:
        n = self.req.n
        prompt_tokens = sum(len(p) for p in self.req.prompts)
        # Per prompt, as vLLM: the cache hit of its first choice.
        cached = sum(self.cached[p * n] for p in range(len(self.req.prompts)))
        return usage(prompt_tokens, sum(self.counts), cached)

    def _text(self, index: int, token_ids: list[int]) -> str:
        words = " ".join(map(self.state.tokenizer.token_str, token_ids))
        if self.counts[index]:
            return " " + words
        if self.req.echo:
            return self._prompt_text(index // self.req.n) + " " + words
        return words

    def _prompt_text(self, prompt_index: int) -> str:
        text = self.req.prompt_texts[prompt_index]
        if text is None:
            text = self.state.tokenizer.decode(self.req.prompts[prompt_index])
        return text

    def _take(self, index: int, out: RequestOutput) -> str:
        text = self._text(index, out.new_token_ids)
        self.counts[index] += len(out.new_token_ids)
        self.cached[index] = out.num_cached_tokens
        return text

    async def collect(self) -> dict[str, Any]:
        texts = [""] * len(self.specs)
        remaining = len(self.specs)
        while remaining:
            index, out = await self.queue.get()
            texts[index] += self._take(index, out)
            remaining -= out.finished
        build = chat_response if self.chat else completion_response
        return build(self.response_id, self.created, self.req.model, texts, self.usage())

    async def events(self) -> AsyncIterator[bytes]:
        rid, created, model = self.response_id, self.created, self.req.model
        extra = {"usage": None} if self.req.include_usage else {}
        if self.chat:
            for index in range(len(self.specs)):
                delta = {"role": "assistant", "content": ""}
                yield _sse({**chat_chunk(rid, created, model, index, delta, False), **extra})
        remaining = len(self.specs)
        while remaining:
            index, out = await self.queue.get()
            text = self._take(index, out)
            remaining -= out.finished
            if self.chat:
                chunk = chat_chunk(rid, created, model, index, {"content": text}, out.finished)
            else:
                chunk = completion_chunk(rid, created, model, index, text, out.finished)
            yield _sse({**chunk, **extra})
        if self.req.include_usage:
            yield _sse(usage_chunk(rid, created, model, self.chat, self.usage()))
        yield b"data: [DONE]\n\n"


def build_app(state: EmulatorState) -> Starlette:
    """The Starlette application serving ``state``."""
    cfg = state.config
    tokenizer = state.tokenizer

    def request_id(request: Request) -> str:
        return request.headers.get("x-request-id") or uuid.uuid4().hex

    async def generate(request: Request, chat: bool) -> Response:
        base_id = request_id(request)
        req = state.parse(parse_body(await request.body()), chat)
        gen = _Generation(state, req, base_id, chat)
        headers = {"x-request-id": base_id}
        gen.submit()
        if req.stream:
            return _EventStream(gen.events(), gen.abort, headers)
        collecting = asyncio.ensure_future(gen.collect())
        watching = asyncio.ensure_future(_wait_disconnect(request.receive))
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
        if not collecting.done():
            collecting.cancel()
            gen.abort()
            # The client is gone; this status only reaches logs.
            return Response(status_code=499)
        watching.cancel()
        return _json(collecting.result(), headers=headers)

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
            ids = chat_prompt(body, tokenizer)
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
        return Response(status_code=200)

    async def server_info(request: Request) -> Response:
        return _json(state.server_info)

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
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(
        routes=routes, exception_handlers={APIError: api_error, HTTPException: http_error}
    )
