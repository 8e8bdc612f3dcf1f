"""The Anthropic Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

``/v1/messages`` takes the chat path (:class:`~router.serving.generate.Generations`): it is
parsed here into a :class:`~router.serving.parsing.ParsedRequest` whose prompt is the chat
template over the request's ``system`` and ``messages`` converted as vLLM converts them
(:mod:`router.tokenization.anthropic`), so the router counts and hashes the tokens the
engine prefills. Only what routing reads is checked (model, messages, max_tokens,
stream, system, cache_salt, metadata.user_id as the session); the engine validates the
rest. The answer is relayed untouched: JSON, or Anthropic's events (``message_start``
... ``message_stop``). ``usage.input_tokens`` does not count cached tokens when the
engine reports them (vLLM's ``--enable-prompt-tokens-details``): the engine's prompt is
``input_tokens + cache_read_input_tokens + cache_creation_input_tokens``
(:func:`router.serving.usage.engine_input_tokens`).

``/v1/messages/count_tokens`` (:class:`CountTokens`) goes to an engine serving the model
by load alone: a count costs the engine a tokenization, never a prefill, so which
engine holds the prefix does not matter, and the least busy one answers soonest.
What the router refuses on these routes is in Anthropic's error form
(:func:`router.serving.errors.shape_for`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from router.frontends.http.body import read_body
from router.frontends.http.downstream import HttpDownstream
from router.policy.base import RouteRequest
from router.serving.context import Outcome, RequestContext
from router.serving.errors import ApiError, bad_request
from router.serving.headers import REQUEST_ID
from router.serving.parsing import MIN_OUTPUT_TOKENS, ParsedRequest, required_int
from router.serving.validate import resolve_model
from router.tokenization.anthropic import chat_messages, has_inline_system
from router.tokenization.base import PromptTokenizer

if TYPE_CHECKING:
    from router.serving.forward import Forwarder
    from router.serving.services import Services

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
_ROLES = ("user", "assistant", "system")


def _required_str(payload: Mapping[str, Any], name: str) -> str:
    value = payload.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{name}' is required (a non-empty string)", name)
    return value


def _blocks(value: Any, name: str) -> None:
    if not all(isinstance(b, dict) and isinstance(b.get("type"), str) for b in value):
        raise bad_request(f"each block of '{name}' must be an object with a 'type'", name)


def _checked_messages(payload: Mapping[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
    """``system`` and ``messages``, shaped as routing reads them (else 400)."""
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    for msg in messages:
        if not isinstance(msg, dict) or msg.get("role") not in _ROLES:
            raise bad_request(
                "each message must be an object with a 'role' of user, assistant or system",
                "messages",
            )
        content = msg.get("content")
        if isinstance(content, list):
            _blocks(content, "messages")
        elif not isinstance(content, str):
            raise bad_request(
                "a message's 'content' must be a string or a list of content blocks", "messages"
            )
    system = payload.get("system")
    if isinstance(system, list):
        _blocks(system, "system")
    elif system is not None and not isinstance(system, str):
        raise bad_request("'system' must be a string or a list of text blocks", "system")
    return system, messages


def parse_messages(payload: dict[str, Any]) -> ParsedRequest:
    """A ``/v1/messages`` body's routing facts (400 for what routing cannot read)."""
    model = _required_str(payload, "model")
    system, messages = _checked_messages(payload)
    max_tokens = required_int(payload, "max_tokens", MIN_OUTPUT_TOKENS)
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    salt = payload.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise bad_request("'cache_salt' must be a string", "cache_salt")
    metadata = payload.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad_request("'metadata' must be an object", "metadata")
    user = (metadata or {}).get("user_id")
    kwargs = payload.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")

    async def render(tokenizer: PromptTokenizer) -> list[int]:
        merge = has_inline_system(messages) and await tokenizer.requires_system_first()
        converted = chat_messages(system, messages, merge) if merge else parsed.messages
        assert converted is not None
        return await tokenizer.chat(converted, True, kwargs)

    parsed = ParsedRequest(
        model,
        bool(stream),
        max_tokens,
        1,
        salt,
        user if isinstance(user, str) else None,
        include_usage=False,
        messages=chat_messages(system, messages),
        template_kwargs=kwargs,
        render=render,
    )
    return parsed


class CountTokens:
    """``POST /v1/messages/count_tokens``: to the least loaded engine serving the model,
    retried on another before the first byte; the engine's answer as it is.

    It takes the engine routes' way (:meth:`~router.serving.forward.Forwarder.by_load`):
    a count is tokenizer work, so its load ticket counts a request in flight and no
    prefill, as ``/tokenize``'s does. Its own intake: draining, the model, the messages
    (Anthropic-shaped refusals), no admission queue.
    """

    def __init__(self, app: Services, forwarder: Forwarder) -> None:
        self.app = app
        self.forwarder = forwarder

    async def handle(self, request: web.Request) -> web.StreamResponse:
        app = self.app
        started = time.perf_counter()
        outcome = Outcome()
        sink = HttpDownstream(request)
        try:
            app.gate.refuse_closed()
            body = await read_body(request)
            body, payload = app.owned.body(body, app.config.limits.max_json_depth)
            model = resolve_model(_required_str(payload, "model"), app.registry.models())
            _checked_messages(payload)
            given = request.headers.get("x-request-id")
            request_id = given if given and REQUEST_ID.fullmatch(given) else os.urandom(16).hex()
            block_size = app.block_size_for(app.registry.base_of(model))
            by_load = RouteRequest(request_id, [], 0, block_size, by_load=True)
            parsed = ParsedRequest(model, False, None, 1, None, None, include_usage=False)
            parsed.prompts = [[]]
            ctx = RequestContext(
                sink, COUNT_TOKENS_PATH, parsed, by_load, payload, body, started, outcome
            )
            await self.forwarder.by_load(ctx)
        except ApiError as err:
            outcome.failed(err)
            raise  # answered in this route's form by the openai_errors middleware
        finally:
            app.metrics.requests.labels("count_tokens", outcome.outcome, str(outcome.status)).inc()
        assert sink.response is not None
        return sink.response
