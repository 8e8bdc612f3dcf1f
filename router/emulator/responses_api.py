"""The emulator's OpenAI Responses API, as vLLM 0.32 serves it (models without Harmony).

``POST /v1/responses`` renders ``instructions`` and ``input`` (a string, or input items)
with the chat template (:mod:`router.tokenization.responses_input`), generates like a chat,
and answers a response object, or streams vLLM's events: ``response.created``,
``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``, ``response.completed`` (each ``event: TYPE`` and
``data: {...}`` with a ``sequence_number``; no ``[DONE]``). A response is stored when
``store`` is true (the default; vLLM needs ``VLLM_ENABLE_RESPONSES_API_STORE=1`` for it),
in this server's memory only: ``GET /v1/responses/{id}`` returns it, ``/cancel`` answers
as vLLM does for a finished one (400), and ``previous_response_id`` continues it, the
prompt being the previous input, its output, then the new input, so prefix caching
applies. Unknown ids are vLLM's 404. ``background`` responses are not emulated (400).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from router.emulator.generation import Generation
from router.emulator.protocol import (
    APIError,
    GenerationRequest,
    check_common_fields,
    encode_json,
    parse_body,
)
from router.emulator.state import EmulatorState
from router.tokenization.responses_input import InvalidInput, output_messages, responses_messages
from router.tokenization.words import render_chat

#: Stored responses one server keeps (the oldest are forgotten first).
MAX_STORED = 10_000
_JSON = "application/json"


@dataclass
class Stored:
    """A stored response and the conversation it answered (for a next turn)."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]


class ResponsesStore:
    """Response id -> what was stored, in one server's memory."""

    def __init__(self, limit: int = MAX_STORED) -> None:
        self.limit = limit
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        return self._items.get(response_id)

    def put(self, response_id: str, stored: Stored) -> None:
        self._items[response_id] = stored
        while len(self._items) > self.limit:
            self._items.popitem(last=False)


def not_found(response_id: str) -> APIError:
    """vLLM's answer for an id it does not hold."""
    return APIError(
        404, f"Response with id '{response_id}' not found.", "response_id", "invalid_request_error"
    )


def _event(kind: str, sequence: int, **fields: Any) -> bytes:
    body = encode_json({**fields, "sequence_number": sequence, "type": kind})
    return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"


class _Turn:
    """One ``POST /v1/responses``: its prompt, its generation, and the answer it builds."""

    def __init__(self, state: EmulatorState, store: ResponsesStore, request: Request, body: Any):
        self.state = state
        self.store = store
        check_common_fields(body)
        model, lora_name, lora_id = state.models.resolve(body.get("model"))
        raw_input = body.get("input")
        if not isinstance(raw_input, (str, list)):
            raise APIError(400, "`input` must be a string or a list of items", "input")
        if body.get("background"):
            raise APIError(400, "background responses are not emulated", "background")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise APIError(400, "`instructions` must be a string", "instructions")
        history: list[dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            stored = store.get(str(previous))
            if stored is None:
                raise not_found(str(previous))
            history = stored.messages + output_messages(stored.response["output"])
        try:
            self.messages = responses_messages(instructions, raw_input, history)
            ids = state.tokenizer.encode(render_chat(self.messages, True))
        except (InvalidInput, ValueError) as exc:
            raise APIError(400, str(exc), "input") from None
        max_output = body.get("max_output_tokens")
        if max_output is not None and (
            isinstance(max_output, bool) or not isinstance(max_output, int) or max_output < 1
        ):
            raise APIError(
                400, "`max_output_tokens` must be a positive integer", "max_output_tokens"
            )
        max_tokens = max_output or state.config.default_max_tokens
        try:
            state.ranks[0].driver.model.validate(len(ids), max_tokens)
        except ValueError as exc:
            raise APIError(400, str(exc), "input") from None
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise APIError(400, "Parameter 'cache_salt' must be a non-empty string.", "cache_salt")
        self.stream = body.get("stream") is True
        self.stored = body.get("store", True) is not False
        self.response_id = str(body.get("request_id") or f"resp_{uuid.uuid4().hex}")
        self.item_id = f"msg_{uuid.uuid4().hex[:16]}"
        self.base = {
            "id": self.response_id,
            "created_at": int(time.time()),
            "incomplete_details": None,
            "instructions": instructions,
            "metadata": body.get("metadata"),
            "model": model,
            "object": "response",
            "output": [],
            "parallel_tool_calls": True,
            "temperature": 1.0,
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "background": False,
            "max_output_tokens": max_output,
            "previous_response_id": previous,
            "status": "in_progress",
            "usage": None,
            "user": body.get("user"),
        }
        req = GenerationRequest(
            model=model,
            lora_name=lora_name,
            lora_id=lora_id,
            prompts=[ids],
            prompt_texts=[None],
            max_tokens=max_tokens,
            n=1,
            stream=self.stream,
            include_usage=False,
            echo=False,
            cache_salt=salt,
            seed=0,
            body=body,
        )
        base_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        self.gen = Generation(state, state.pick_rank(request.headers), req, base_id, chat=True)
        self.text = ""
        self.finish_reason: str | None = None

    async def _step(self) -> str:
        _, text, out = await self.gen.next_output()
        self.text += text
        if out.finished:
            self.finish_reason = out.finish_reason
        return text

    def message(self, status: str) -> dict[str, Any]:
        part = {"annotations": [], "text": self.text, "type": "output_text", "logprobs": None}
        return {
            "id": self.item_id,
            "content": [part] if status == "completed" else [],
            "role": "assistant",
            "status": status,
            "type": "message",
        }

    def finished(self) -> dict[str, Any]:
        """The final response object, stored if asked."""
        gen = self.gen
        prompt = len(gen.req.prompts[0])
        length = self.finish_reason == "length"
        response = {
            **self.base,
            "incomplete_details": {"reason": "max_output_tokens"} if length else None,
            "output": [self.message("completed")],
            "status": "incomplete" if length else "completed",
            "usage": {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": gen.cached[0]},
                "output_tokens": gen.counts[0],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + gen.counts[0],
            },
        }
        if self.stored:
            self.store.put(self.response_id, Stored(response, self.messages))
        return response

    async def whole(self) -> dict[str, Any]:
        await self.gen.start()
        while not self.gen.finished:
            await self._step()
        return self.finished()

    async def events(self) -> AsyncIterator[bytes]:
        seq = 0

        def event(kind: str, **fields: Any) -> bytes:
            nonlocal seq
            seq += 1
            return _event(kind, seq - 1, **fields)

        where = {"item_id": self.item_id, "output_index": 0}
        try:
            yield event("response.created", response=self.base)
            yield event("response.in_progress", response=self.base)
            await self.gen.start()
            first = await self._step()
            yield event(
                "response.output_item.added", item=self.message("in_progress"), output_index=0
            )
            empty = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
            yield event("response.content_part.added", content_index=0, part=empty, **where)
            delta = first
            while True:
                if delta:
                    yield event(
                        "response.output_text.delta",
                        content_index=0,
                        delta=delta,
                        logprobs=[],
                        **where,
                    )
                if self.gen.finished:
                    break
                delta = await self._step()
            yield event(
                "response.output_text.done", content_index=0, text=self.text, logprobs=[], **where
            )
            part = self.message("completed")["content"][0]
            yield event("response.content_part.done", content_index=0, part=part, **where)
            yield event("response.output_item.done", item=self.message("completed"), output_index=0)
            yield event("response.completed", response=self.finished())
        finally:
            self.gen.close(client_gone=not self.gen.finished)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def responses_routes(state: EmulatorState) -> list[Route]:
    """The Responses API routes over ``state`` (each server its own store)."""
    store = ResponsesStore()

    def json(body: Any, status: int = 200) -> Response:
        return Response(encode_json(body), status_code=status, media_type=_JSON)

    async def create(request: Request) -> Response:
        turn = _Turn(state, store, request, parse_body(await request.body()))
        headers = turn.gen.headers()
        if turn.stream:
            return StreamingResponse(turn.events(), media_type="text/event-stream", headers=headers)
        answering = asyncio.ensure_future(turn.whole())
        watching = asyncio.ensure_future(_wait_disconnect(request))
        await asyncio.wait({answering, watching}, return_when=asyncio.FIRST_COMPLETED)
        watching.cancel()
        if not answering.done():
            answering.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await answering
            turn.gen.close(client_gone=True)
            return Response(status_code=499)  # the client is gone; only logs see it
        turn.gen.close(client_gone=False)
        return Response(
            encode_json(answering.result()), media_type=_JSON, headers=headers, status_code=200
        )

    async def retrieve(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        stored = store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return json(stored.response)

    async def cancel(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if store.get(response_id) is None:
            raise not_found(response_id)
        raise APIError(
            400, "Cannot cancel a synchronous response.", "response_id", "invalid_request_error"
        )

    async def no_renderer(request: Request) -> Response:
        # The emulator renders no Responses request (vLLM 0.32 does only with
        # --enable-scale-out): the route is absent, as on an engine without it, rather
        # than a 405 from the `{response_id}` route below. The router falls back to
        # /tokenize either way.
        raise APIError(404, "this engine does not render Responses requests", None, "NotFoundError")

    return [
        Route("/v1/responses", create, methods=["POST"]),
        Route("/v1/responses/render", no_renderer, methods=["POST"]),
        Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"]),
    ]
