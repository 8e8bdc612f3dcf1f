"""Parse OpenAI completion and chat requests into what routing needs.

The hot path decodes the body with msgspec into plain objects and checks only what
routing reads; the engine validates the rest (and its 4xx answers pass through). The
pydantic models at the bottom describe the request bodies for the OpenAPI document
and are not used per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from router.api.errors import ApiError, bad_request
from router.config import LimitsConfig
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
    prompts: list[list[int]] = field(default_factory=list)
    """Token ids of every prompt, once tokenized."""

    @property
    def routing_prompt(self) -> list[int]:
        """The prompt routing follows: the longest one in a batch."""
        return max(self.prompts, key=len)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens as the engine counts them in ``usage`` (once per prompt)."""
        return sum(len(p) for p in self.prompts)


async def tokenize(parsed: ParsedRequest, tokenizer: PromptTokenizer) -> list[list[int]]:
    """Token ids of the request's prompts (TokenizeError becomes a 400)."""
    try:
        if parsed.messages is not None:
            return [
                await tokenizer.chat(
                    parsed.messages, parsed.add_generation_prompt, parsed.template_kwargs
                )
            ]
        assert parsed.texts is not None
        return [p if isinstance(p, list) else await tokenizer.prompt(p) for p in parsed.texts]
    except TokenizeError as exc:
        param = "messages" if parsed.messages is not None else "prompt"
        raise bad_request(str(exc), param) from None


def decode_body(body: bytes, max_depth: int = 32) -> dict[str, Any]:
    """The request's JSON object; 400 for invalid JSON, invalid UTF-8 or nesting deeper
    than ``max_depth`` containers."""
    try:
        payload = _decode(body)
    except msgspec.DecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec stops at the interpreter's recursion limit
        raise bad_request(f"request body nests JSON deeper than {max_depth} levels") from None
    if not isinstance(payload, dict):
        raise bad_request("request body must be a JSON object")
    if _too_deep(payload, max_depth):
        raise bad_request(f"request body nests JSON deeper than {max_depth} levels")
    return payload


def _too_deep(payload: dict[str, Any], max_depth: int) -> bool:
    """Whether containers nest deeper than ``max_depth`` (iterative: no recursion).

    A list that starts and ends with a scalar is taken as a list of scalars (token ids,
    texts) without reading it all, so the check costs microseconds even for a
    100,000-token prompt. Nesting hidden in the middle of such a list is not seen here,
    but msgspec has bounded the depth already, and the parsers reject mixed prompt
    lists.
    """
    stack: list[tuple[Any, int]] = [(payload, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        node, depth = pop()
        if type(node) is dict:
            children: Any = node.values()
        elif not node or (type(node[0]) not in _NESTED and type(node[-1]) not in _NESTED):
            continue
        else:
            children = node
        for child in children:
            if type(child) in _NESTED:
                if depth >= max_depth:
                    return True
                push((child, depth + 1))
    return False


_NESTED = frozenset((dict, list))


def check_limits(parsed: ParsedRequest, limits: LimitsConfig) -> None:
    """Bounds on what a request may ask for (before any routing or tokenizing)."""
    if parsed.n > limits.max_n:
        raise bad_request(f"'n' must be at most {limits.max_n}", "n")
    if parsed.max_tokens is not None and parsed.max_tokens > limits.max_output_tokens:
        raise bad_request(f"'max_tokens' must be at most {limits.max_output_tokens}", "max_tokens")
    count = len(parsed.texts) if parsed.texts is not None else len(parsed.messages or ())
    if count > limits.max_prompts:
        what = "prompts" if parsed.texts is not None else "messages"
        raise bad_request(
            f"at most {limits.max_prompts} {what} per request, got {count}",
            "prompt" if parsed.texts is not None else "messages",
        )


def check_prompt_tokens(parsed: ParsedRequest, limits: LimitsConfig) -> None:
    """The tokenized prompts stay within ``limits.max_prompt_tokens`` (each)."""
    longest = max((len(p) for p in parsed.prompts), default=0)
    if longest > limits.max_prompt_tokens:
        raise ApiError(
            400,
            f"the prompt has {longest} tokens; this router accepts at most "
            f"{limits.max_prompt_tokens}",
            param="messages" if parsed.messages is not None else "prompt",
            code="context_length_exceeded",
        )


def _opt_int(payload: dict[str, Any], name: str, minimum: int) -> int | None:
    value = payload.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer", name)
    if value < minimum:
        raise bad_request(f"'{name}' must be at least {minimum}", name)
    return value


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


def _common(payload: dict[str, Any]) -> ParsedRequest:
    model = _opt_str(payload, "model")
    stream = payload.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    max_tokens = _opt_int(payload, "max_tokens", 0)
    if max_tokens is None:
        max_tokens = _opt_int(payload, "max_completion_tokens", 0)
    n = _opt_int(payload, "n", 1) or 1
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
    parsed = _common(payload)
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
    parsed.messages = messages
    parsed.add_generation_prompt = bool(payload.get("add_generation_prompt", True))
    parsed.template_kwargs = kwargs
    return parsed


def resolve_model(requested: str | None, served: Sequence[str]) -> str:
    """The model to route for: the requested one if served, the only one if omitted."""
    if not served:  # no engine reached yet: not the client's mistake
        raise ApiError(
            503,
            "no engine serves any model yet (engines unreachable or still starting)",
            retry_after=1,
        )
    if requested is None:
        if len(served) == 1:
            return served[0]
        raise bad_request("'model' is required when several models are served", "model")
    if requested not in served:
        listed = ", ".join(served) or "none"
        raise ApiError(
            404,
            f"The model '{requested}' does not exist. Served models: {listed}",
            param="model",
            code="model_not_found",
        )
    return requested


# --------------------------------------------------------------------------- OpenAPI models


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(BaseModel):
    include_usage: bool | None = None


class CompletionRequest(_Body):
    """POST /v1/completions. Fields beyond these pass through to the engine."""

    model: str | None = Field(None, description="Served model or LoRA adapter name.")
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="Text, texts, token ids, or lists of token ids (non-empty)."
    )
    max_tokens: int | None = Field(None, ge=0)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    cache_salt: str | None = Field(None, description="Isolates prefix caching per tenant.")
    user: str | None = Field(None, description="Also the session key of the session policy.")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str = Field(description="system, user, assistant, tool, developer, or a custom role.")
    content: str | list[Any] | None = None


class ChatCompletionRequest(_Body):
    """POST /v1/chat/completions. Fields beyond these pass through to the engine."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    cache_salt: str | None = None
    user: str | None = None
