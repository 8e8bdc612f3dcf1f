"""The emulator's Anthropic Messages API, served as vLLM 0.32 serves it.

vLLM converts a ``/v1/messages`` request into a chat completion (its ``system`` and
content blocks become chat messages: :mod:`router.tokenization.anthropic`, where the
emulator's template takes system messages anywhere, so none are merged), runs it, and
converts the answer: a ``message`` object, or the events ``message_start`` (usage with
the whole prompt as ``input_tokens``), ``content_block_start`` / ``content_block_delta``
(``text_delta``) / ``content_block_stop``, ``message_delta`` (the stop reason and the
final usage) and ``message_stop``, each as ``event: NAME`` and one ``data:`` line.
``usage.input_tokens`` leaves out the cached tokens, reported as
``cache_read_input_tokens`` (vLLM with ``--enable-prompt-tokens-details``, as the
emulator always reports them).

Errors: a body that does not validate is vLLM's OpenAI-shaped 400 (its request model
rejects it before the Messages handler runs); what the handler refuses after that
(an unknown model, a prompt that does not fit) is Anthropic-shaped,
``{"type": "error", "error": {"type", "message"}}`` with vLLM's error type names.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.emulator.generation import Generation
from router.emulator.protocol import (
    APIError,
    chat_prompt,
    check_common_fields,
    encode_json,
    parse_body,
)
from router.emulator.state import EmulatorState
from router.tokenization.anthropic import chat_messages

_JSON = "application/json"
_ROLES = ("user", "assistant", "system")
#: Fields a Messages request shares with the chat request vLLM turns it into.
_CHAT_FIELDS = ("model", "cache_salt", "kv_transfer_params", "chat_template_kwargs", "seed")

#: ``generate(request, chat, body, generation class)``: the emulator's generation handler.
Generate = Callable[[Request, bool, dict[str, Any], type[Generation]], Awaitable[Response]]


def _invalid(message: str, field: str) -> APIError:
    return APIError(400, message, f"body.{field}", "Bad Request")


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion body a Messages body becomes (400, OpenAI-shaped, for what
    vLLM's request model refuses)."""
    check_common_fields(body)
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise _invalid("Field required: model", "model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and m.get("role") in _ROLES and isinstance(m.get("content"), str | list)
        for m in messages
    ):
        raise _invalid("messages: a list of {role, content} is required", "messages")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise _invalid("Field required: max_tokens", "max_tokens")
    if max_tokens <= 0:
        raise _invalid("max_tokens must be positive", "max_tokens")
    chat: dict[str, Any] = {k: body[k] for k in _CHAT_FIELDS if body.get(k) is not None}
    chat["messages"] = chat_messages(body.get("system"), messages)
    chat["max_tokens"] = max_tokens
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def anthropic_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """A chat ``usage`` as Anthropic's: cached tokens apart from ``input_tokens``."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": max(0, usage["prompt_tokens"] - cached),
        "output_tokens": usage.get("completion_tokens") or 0,
        "cache_read_input_tokens": cached,
    }


def stop_reason(finish_reason: str | None, matched: Any) -> tuple[str | None, str | None]:
    """vLLM's (stop_reason, stop_sequence) for a chat finish reason."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason != "stop":
        return None, None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def event(name: str, data: dict[str, Any]) -> bytes:
    """One Anthropic server-sent event."""
    return b"event: " + name.encode() + b"\ndata: " + encode_json(data) + b"\n\n"


class MessagesGeneration(Generation):
    """A Messages request's generation: the chat one, answered in Anthropic's shapes."""

    async def collect(self) -> dict[str, Any]:
        chat = await super().collect()
        choice = chat["choices"][0]
        reason, sequence = stop_reason(choice["finish_reason"], choice["stop_reason"])
        text = choice["message"]["content"] or ""
        answer: dict[str, Any] = {
            "id": chat["id"],
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": text}],
            "model": chat["model"],
            "stop_reason": reason,
        }
        if sequence is not None:
            answer["stop_sequence"] = sequence
        answer["usage"] = anthropic_usage(chat["usage"])
        if chat.get("kv_transfer_params") is not None:
            answer["kv_transfer_params"] = chat["kv_transfer_params"]
        return answer

    async def events(self) -> AsyncIterator[tuple[bytes, int]]:
        index, out = await self.queue.get()
        text = self._take(index, out)
        prompt = sum(len(p) for p in self.req.prompts)
        message = {
            "id": self.response_id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.req.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt, "output_tokens": 0},
        }
        yield event("message_start", {"type": "message_start", "message": message}), 0
        started = False
        while True:
            chunk = b""
            if text:
                if not started:
                    started = True
                    block = {"type": "text", "text": ""}
                    start = {"type": "content_block_start", "content_block": block, "index": 0}
                    chunk += event("content_block_start", start)
                delta = {"type": "text_delta", "text": text}
                body = {"type": "content_block_delta", "delta": delta, "index": 0}
                chunk += event("content_block_delta", body)
            yield chunk, len(out.new_token_ids)
            if self.finished:
                break
            index, out = await self.queue.get()
            text = self._take(index, out)
        tail = b""
        if started:
            tail += event("content_block_stop", {"type": "content_block_stop", "index": 0})
        reason, sequence = stop_reason(out.finish_reason, out.stop_reason)
        final = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": anthropic_usage(self.usage()),
        }
        tail += event("message_delta", final)
        tail += event("message_stop", {"type": "message_stop"})
        yield tail, 0


def _anthropic_error(exc: APIError) -> Response:
    body = {"type": "error", "error": {"type": exc.body()["error"]["type"], "message": exc.message}}
    return Response(encode_json(body), status_code=exc.status, media_type=_JSON)


def routes(state: EmulatorState, generate: Generate) -> list[Route]:
    """``/v1/messages`` and ``/v1/messages/count_tokens`` over ``generate``."""

    async def messages(request: Request) -> Response:
        body = chat_body(parse_body(await request.body()))
        try:
            return await generate(request, True, body, MessagesGeneration)
        except APIError as exc:
            return _anthropic_error(exc)

    async def count_tokens(request: Request) -> Response:
        body = parse_body(await request.body())
        chat = chat_body({**body, "max_tokens": 1})
        try:
            state.models.resolve(chat.get("model"))
            ids, _ = chat_prompt(chat, state.tokenizer, state.config.mm_placeholder_tokens)
            count = len(ids)
        except APIError as exc:
            return _anthropic_error(exc)
        answer = {"input_tokens": count, "context_management": {"original_input_tokens": count}}
        return Response(encode_json(answer), media_type=_JSON)

    return [
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]
