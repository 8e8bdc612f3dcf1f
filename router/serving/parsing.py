"""Parse OpenAI completion and chat requests into what routing needs.

The hot path decodes the body with msgspec into plain objects and checks only what
routing reads; the engine validates the rest (and its 4xx answers pass through). The
request bodies as the OpenAPI document describes them are the HTTP front end's
(:mod:`router.frontends.http.openapi`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from router.media import MediaSpan
from router.serving.errors import bad_request
from router.tokenization.base import PromptTokenizer, TokenizeError

_decode = msgspec.json.Decoder().decode
_MAX_TOKEN_ID = 2**32


@dataclass(slots=True)
class ParsedRequest:
    """The routing-relevant facts of one completion or chat request."""

    model: str | None
    stream: bool
    max_tokens: int | None
    n: int
    cache_salt: str | None
    user: str | None
    include_usage: bool
    texts: list[str | list[int]] | None = None
    """A completion's prompts: texts or token-id lists."""
    messages: list[dict[str, Any]] | None = None
    """A chat's messages."""
    add_generation_prompt: bool = True
    template_kwargs: dict[str, Any] | None = None
    max_completion_tokens: int | None = None
    """A chat's ``max_completion_tokens`` (a completion's is not read, as in vLLM)."""
    max_output_tokens: int | None = None
    """A Responses request's output bound (``max_output_tokens``)."""
    responses: dict[str, Any] | None = None
    """A Responses request's fields its rendering reads (``instructions``, ``input``,
    tools...; never the conversation state); ``messages`` holds the equivalent chat."""
    previous_response_id: str | None = None
    """The stored response a Responses request continues."""
    prompts: list[Sequence[int]] = field(default_factory=list)
    """Token ids of every prompt, once tokenized."""
    media: list[MediaSpan] = field(default_factory=list)
    """Where a chat's media items (images, audio, video) sit in its tokens, once
    tokenized; block keys fold them in."""
    render: Callable[[PromptTokenizer], Awaitable[list[int]]] | None = None
    """How another API's request becomes its one prompt (e.g. Anthropic Messages,
    :mod:`router.frontends.http.anthropic`); None: ``messages`` or ``texts`` as they are."""

    @property
    def output_tokens(self) -> int | None:
        """Output tokens the engine may generate per sequence: ``max_completion_tokens``
        when set (it takes precedence over ``max_tokens``, as in vLLM)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        if self.max_output_tokens is not None:
            return self.max_output_tokens
        return self.max_tokens

    @property
    def routing_prompt(self) -> Sequence[int]:
        """The prompt routing follows: the longest one in a batch."""
        return max(self.prompts, key=len)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens as the engine counts them in ``usage`` (once per prompt)."""
        return sum(len(p) for p in self.prompts)


async def tokenize(parsed: ParsedRequest, tokenizer: PromptTokenizer) -> list[Sequence[int]]:
    """Token ids of the request's prompts (TokenizeError becomes a 400); a chat's media
    spans go to ``parsed.media``."""
    try:
        if parsed.render is not None:
            return [await parsed.render(tokenizer)]
        if parsed.responses is not None:
            assert parsed.messages is not None
            return [
                await tokenizer.responses(parsed.responses, parsed.messages, parsed.template_kwargs)
            ]
        if parsed.messages is not None:
            chat = await tokenizer.chat_prompt(
                parsed.messages, parsed.add_generation_prompt, parsed.template_kwargs
            )
            parsed.media = chat.media
            return [chat.tokens]
        assert parsed.texts is not None
        return [p if isinstance(p, list) else await tokenizer.prompt(p) for p in parsed.texts]
    except TokenizeError as exc:
        raise bad_request(str(exc), prompt_param(parsed)) from None


def prompt_param(parsed: ParsedRequest) -> str:
    """The request field holding its prompt, for errors about it."""
    if parsed.responses is not None:
        return "input"
    return "messages" if parsed.messages is not None else "prompt"


def decode_body(body: bytes, max_depth: int = 32) -> dict[str, Any]:
    """The request's JSON object; 400 for invalid JSON, invalid UTF-8 or nesting deeper
    than ``max_depth`` containers. Every JSON body the router reads goes through here
    (the OpenAI API over HTTP, gRPC and ext_proc, the admin API, the sidecar)."""
    try:
        payload = _decode(body)
    except msgspec.DecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec stops at the interpreter's recursion limit
        raise bad_request(f"request body nests JSON deeper than {max_depth} levels") from None
    if not isinstance(payload, dict):
        raise bad_request("request body must be a JSON object")
    if too_deep(payload, max_depth):
        raise bad_request(f"request body nests JSON deeper than {max_depth} levels")
    return payload


def too_deep(payload: dict[str, Any] | list[Any], max_depth: int) -> bool:
    """Whether containers nest deeper than ``max_depth``, at any position (iterative:
    no recursion).

    Each container's members are checked for containers at C speed (``map(type, ...)``
    into ``isdisjoint``), so a 100,000-token prompt costs under 2 ms; only containers
    are walked in Python.
    """
    stack: list[tuple[Any, int]] = [(payload, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        node, depth = pop()
        members = node.values() if type(node) is dict else node
        if _NESTED.isdisjoint(map(type, members)):
            continue
        if depth >= max_depth:
            return True
        for member in members:
            if type(member) in _NESTED:
                push((member, depth + 1))
    return False


_NESTED = frozenset((dict, list))


def optional_int(payload: Mapping[str, Any], name: str, minimum: int) -> int | None:
    """``payload[name]``, an integer of at least ``minimum``, or None when absent; else
    400 saying what is wrong with the value. Every API's integer fields are read here,
    so each says the same of the same mistake."""
    value = payload.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer", name)
    if value < minimum:
        raise bad_request(f"'{name}' must be at least {minimum}, got {value}", name)
    return value


def required_int(payload: Mapping[str, Any], name: str, minimum: int) -> int:
    """:func:`optional_int` for a field the API requires."""
    value = optional_int(payload, name, minimum)
    if value is None:
        raise bad_request(f"'{name}' is required", name)
    return value


#: The least output an engine runs: vLLM 0.32 refuses ``max_tokens`` (and
#: ``max_completion_tokens``, ``max_output_tokens``) below 1, except a completion that
#: only echoes its prompt (``echo`` with ``max_tokens: 0``).
MIN_OUTPUT_TOKENS = 1


def _opt_str(payload: dict[str, Any], name: str) -> str | None:
    value = payload.get(name)
    if value is None or isinstance(value, str):
        return value
    raise bad_request(f"'{name}' must be a string", name)


def _token_ids(ids: list[Any]) -> list[int]:
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < _MAX_TOKEN_ID:
            raise bad_request("token ids must be integers in [0, 2^32)", "prompt")
    return ids


def _prompts(value: Any) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(isinstance(p, int) and not isinstance(p, bool) for p in value):
            return [_token_ids(value)]
        if all(isinstance(p, list) for p in value):
            return [_token_ids(p) for p in value]
    raise bad_request(
        "'prompt' must be a string, a list of strings, a list of token ids, "
        "or a list of token-id lists",
        "prompt",
    )


def _common(payload: dict[str, Any], min_tokens: int = MIN_OUTPUT_TOKENS) -> ParsedRequest:
    model = _opt_str(payload, "model")
    stream = payload.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    max_tokens = optional_int(payload, "max_tokens", min_tokens)
    n = optional_int(payload, "n", 1) or 1
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    include_usage = bool(options and options.get("include_usage"))
    if options and not isinstance(options.get("include_usage", False), (bool, type(None))):
        raise bad_request("'stream_options.include_usage' must be a boolean", "stream_options")
    return ParsedRequest(
        model,
        stream,
        max_tokens,
        n,
        _opt_str(payload, "cache_salt"),
        _opt_str(payload, "user"),
        include_usage,
    )


def parse_completion(payload: dict[str, Any]) -> ParsedRequest:
    if "prompt" not in payload:
        raise bad_request("'prompt' is required", "prompt")
    texts = _prompts(payload["prompt"])
    if any(not p for p in texts):
        raise bad_request("'prompt' must not be empty", "prompt")
    parsed = _common(payload, 0 if payload.get("echo") is True else MIN_OUTPUT_TOKENS)
    parsed.texts = texts
    return parsed


def parse_chat(payload: dict[str, Any]) -> ParsedRequest:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    for msg in messages:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise bad_request("each message must be an object with a 'role'", "messages")
        content = msg.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise bad_request(
                "a message's 'content' must be a string, a list of parts, or null", "messages"
            )
    kwargs = payload.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    parsed = _common(payload)
    parsed.max_completion_tokens = optional_int(payload, "max_completion_tokens", MIN_OUTPUT_TOKENS)
    parsed.messages = messages
    parsed.add_generation_prompt = bool(payload.get("add_generation_prompt", True))
    parsed.template_kwargs = kwargs
    return parsed
