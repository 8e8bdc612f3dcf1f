"""vLLM's OpenAI-compatible request and response shapes, as the emulator speaks them.

Parsing turns a JSON body into a ``GenerationRequest`` (token ids per prompt, limits,
streaming options) or raises ``APIError`` with the status vLLM would answer. Builders
produce response bodies field for field as vLLM serialises them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from router.media import DEFAULT_MM_PLACEHOLDER_TOKENS, MediaSpan
from router.tokenization.words import VOCAB_SIZE, WordTokenizer, render_chat_media

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestEntityTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
_MAX_N = 128
#: Sampling fields echoed by the render endpoints when the client sent them.
_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
    "min_tokens", "logprobs",
)  # fmt: skip

_json_decoder = msgspec.json.Decoder()
encode_json = msgspec.json.Encoder().encode


class APIError(Exception):
    """A request the emulator refuses, with the HTTP status and OpenAI error body."""

    def __init__(
        self, status: int, message: str, param: str | None = None, err_type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.err_type)


def error_body(
    status: int, message: str, param: str | None = None, err_type: str | None = None
) -> dict[str, Any]:
    """vLLM's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    err_type = err_type or _ERROR_TYPES.get(status, "BadRequestError")
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


@dataclass(frozen=True)
class ServedModels:
    """The model name and LoRA adapters a server answers for."""

    base: str
    loras: Mapping[str, int]

    def resolve(self, name: Any) -> tuple[str, str | None, int | None]:
        """(served name, adapter name, adapter id) for a request's ``model`` field."""
        if name is None:
            return self.base, None, None
        if name == self.base:
            return name, None, None
        if isinstance(name, str) and name in self.loras:
            return name, name, self.loras[name]
        raise APIError(404, f"The model `{name}` does not exist.", "model")


@dataclass(frozen=True)
class Bootstrap:
    """SGLang's disaggregation fields: where the prefill engine's bootstrap listener is
    and which room pairs the two legs of one request."""

    host: str | None
    port: int | None
    room: int


@dataclass(frozen=True)
class ChoiceResult:
    """One finished choice of a non-streaming answer."""

    text: str
    finish_reason: str
    stop_reason: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """A completion or chat request reduced to what the engine model needs."""

    model: str
    lora_name: str | None
    lora_id: int | None
    prompts: list[list[int]]
    #: The prompt texts, for ``echo`` (None for token-id prompts).
    prompt_texts: list[str | None]
    max_tokens: int
    n: int
    stream: bool
    include_usage: bool
    echo: bool
    cache_salt: str | None
    seed: int
    body: dict[str, Any]
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    #: vLLM's disaggregation parameters (NixlConnector), as sent.
    kv_transfer_params: dict[str, Any] | None = None
    bootstrap: Bootstrap | None = None
    #: Where a chat's media items sit in its prompt (their placeholder tokens).
    media: tuple[MediaSpan, ...] = ()
    #: ``echo`` with ``max_tokens: 0``: as vLLM, one token is generated and the answer's
    #: text is the prompt alone.
    echo_only: bool = False

    @property
    def num_sequences(self) -> int:
        return len(self.prompts) * self.n


# ---------------------------------------------------------------------- parsing


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = _json_decoder.decode(raw)
    except msgspec.DecodeError as exc:
        # vLLM answers a body that is not JSON from FastAPI's validation handler, typed
        # with the HTTP reason phrase rather than an exception name.
        raise APIError(400, f"JSON decode error: {exc}", err_type="Bad Request") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _int(body: Mapping[str, Any], name: str, default: int | None, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"`{name}` must be an integer", name)
    if value < minimum:
        raise APIError(400, f"`{name}` must be at least {minimum}, got {value}", name)
    return value


def _bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"`{name}` must be a boolean", name)
    return value


def check_token_ids(ids: Any, param: str) -> list[int]:
    """Validate a token-id list: ints in [0, VOCAB_SIZE)."""
    if not isinstance(ids, list):
        raise APIError(400, f"`{param}` must be a list of token ids", param)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise APIError(400, f"`{param}` must hold integer token ids", param)
        if not 0 <= t < VOCAB_SIZE:
            raise APIError(400, f"Token id {t} is out of vocabulary", param)
    return ids


def _stop_token_ids(body: Mapping[str, Any]) -> frozenset[int]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return frozenset()
    if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
        raise APIError(400, "`stop_token_ids` must be a list of token ids", "stop_token_ids")
    return frozenset(ids)


def _xarg(value: Any) -> bool:
    scalar = (str, int, float)
    return isinstance(value, scalar) or (
        isinstance(value, list) and all(isinstance(v, scalar) for v in value)
    )


def _number(value: Any) -> bool:
    """What pydantic's lax ``float`` takes: a number, a boolean, a numeric string."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return False
        return True
    return isinstance(value, int | float)


def check_common_fields(body: Mapping[str, Any]) -> None:
    """Fields every generation API of vLLM 0.32 types alike (its request models refuse
    another type before anything runs, 400 ``Bad Request``): ``temperature`` a number,
    ``vllm_xargs`` an object of strings, numbers or lists of them (so no object can reach
    ``SamplingParams.extra_args`` through it)."""
    temperature = body.get("temperature")
    if temperature is not None and not _number(temperature):
        raise APIError(400, "`temperature` must be a number", "body.temperature", "Bad Request")
    xargs = body.get("vllm_xargs")
    if xargs is not None and (
        not isinstance(xargs, dict) or not all(_xarg(v) for v in xargs.values())
    ):
        raise APIError(
            400,
            "`vllm_xargs` must map names to strings, numbers or lists of them",
            "body.vllm_xargs",
            "Bad Request",
        )


def _kv_transfer_params(body: Mapping[str, Any]) -> dict[str, Any] | None:
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise APIError(400, "`kv_transfer_params` must be an object", "kv_transfer_params")
    return params


def _bootstrap(body: Mapping[str, Any]) -> Bootstrap | None:
    host, port, room = (body.get(f"bootstrap_{k}") for k in ("host", "port", "room"))
    if host is None and port is None and room is None:
        return None
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 1 << 64:
        raise APIError(400, "`bootstrap_room` must be an integer in [0, 2**64)", "bootstrap_room")
    if host is not None and not isinstance(host, str):
        raise APIError(400, "`bootstrap_host` must be a string", "bootstrap_host")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)):
        raise APIError(400, "`bootstrap_port` must be an integer", "bootstrap_port")
    return Bootstrap(host, port, room)


def completion_prompts(
    prompt: Any, tokenizer: WordTokenizer
) -> tuple[list[list[int]], list[str | None]]:
    """vLLM's accepted ``prompt`` forms: text, token ids, or a list of either."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        items = prompt
    elif isinstance(prompt, list) and prompt:
        items = [prompt]
    else:
        raise APIError(
            400, "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
        )
    ids: list[list[int]] = []
    texts: list[str | None] = []
    for item in items:
        if isinstance(item, str):
            ids.append(tokenizer.encode(item))
            texts.append(item)
        else:
            ids.append(check_token_ids(item, "prompt"))
            texts.append(None)
        if not ids[-1]:
            raise APIError(400, "the prompt must hold at least one token", "prompt")
    return ids, texts


def chat_prompt(
    body: Mapping[str, Any],
    tokenizer: WordTokenizer,
    placeholder_tokens: int = DEFAULT_MM_PLACEHOLDER_TOKENS,
) -> tuple[list[int], list[MediaSpan]]:
    """A chat's token ids, and where its media items' placeholder tokens sit (each image,
    audio or video part is ``placeholder_tokens`` marker tokens in place)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "`messages` must be a non-empty list", "messages")
    if not all(isinstance(m, dict) for m in messages):
        raise APIError(400, "each message must be an object", "messages")
    add_generation_prompt = body.get("add_generation_prompt", True)
    try:
        text, media = render_chat_media(messages, bool(add_generation_prompt), placeholder_tokens)
    except ValueError as exc:
        raise APIError(400, str(exc), "messages") from None
    return tokenizer.encode(text), media


def parse_generation(
    body: dict[str, Any],
    chat: bool,
    models: ServedModels,
    tokenizer: WordTokenizer,
    default_max_tokens: int,
    placeholder_tokens: int = DEFAULT_MM_PLACEHOLDER_TOKENS,
) -> GenerationRequest:
    """Validate a ``/v1/completions`` (``chat=False``) or ``/v1/chat/completions`` body."""
    check_common_fields(body)
    model, lora_name, lora_id = models.resolve(body.get("model"))
    media: list[MediaSpan] = []
    if chat:
        ids, media = chat_prompt(body, tokenizer, placeholder_tokens)
        prompts, texts = [ids], [None]
        max_tokens = _int(body, "max_completion_tokens", None, 1)
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens", default_max_tokens, 1)
    else:
        prompts, texts = completion_prompts(body.get("prompt"), tokenizer)
        echo = _bool(body, "echo")
        max_tokens = _int(body, "max_tokens", default_max_tokens, 0 if echo else 1)
    assert max_tokens is not None
    echo_only = not chat and max_tokens == 0
    max_tokens = max(max_tokens, 1)
    n = _int(body, "n", 1, 1)
    assert n is not None
    if n > _MAX_N:
        raise APIError(400, f"`n` must be at most {_MAX_N}", "n")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise APIError(
                400, "Stream options can only be defined when `stream=True`.", "stream_options"
            )
        if not isinstance(options, dict):
            raise APIError(400, "`stream_options` must be an object", "stream_options")
    include_usage = bool(options and options.get("include_usage"))
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise APIError(
            400, "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
        )
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise APIError(400, "`seed` must be an integer", "seed")
    min_tokens = _int(body, "min_tokens", 0, 0)
    assert min_tokens is not None
    if min_tokens > max_tokens:
        raise APIError(
            400,
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
            "min_tokens",
        )
    return GenerationRequest(
        model=model,
        lora_name=lora_name,
        lora_id=lora_id,
        prompts=prompts,
        prompt_texts=texts,
        max_tokens=max_tokens,
        n=n,
        stream=stream,
        include_usage=include_usage,
        echo=not chat and _bool(body, "echo"),
        cache_salt=salt,
        seed=seed or 0,
        body=body,
        stop_token_ids=_stop_token_ids(body),
        min_tokens=min_tokens,
        kv_transfer_params=_kv_transfer_params(body),
        bootstrap=_bootstrap(body),
        media=tuple(media),
        echo_only=echo_only,
    )


# ---------------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_response(
    rid: str,
    created: int,
    model: str,
    choices: Sequence[ChoiceResult],
    usage_info: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": i,
                "text": c.text,
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "prompt_logprobs": None,
            }
            for i, c in enumerate(choices)
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_info,
        "kv_transfer_params": kv_transfer_params,
    }


def chat_response(
    rid: str,
    created: int,
    model: str,
    choices: Sequence[ChoiceResult],
    usage_info: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": i,
                "message": {
                    "role": "assistant",
                    "content": c.text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for i, c in enumerate(choices)
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_info,
        "prompt_logprobs": None,
        "kv_transfer_params": kv_transfer_params,
    }


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    text: str,
    finish_reason: str | None,
    stop_reason: int | None = None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        ],
    }


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    delta: dict[str, Any],
    finish_reason: str | None,
    stop_reason: int | None = None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason,
                **({"stop_reason": stop_reason} if finish_reason is not None else {}),
            }
        ],
    }


def usage_chunk(
    rid: str, created: int, model: str, chat: bool, usage_info: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_info,
    }


def render_result(request_id: str, token_ids: list[int], req: GenerationRequest) -> dict[str, Any]:
    """One ``GenerateRequest`` as vLLM's render endpoints return it."""
    body = req.body
    sampling: dict[str, Any] = {"n": req.n, "max_tokens": req.max_tokens}
    sampling.update({k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None})
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "assistant_tokens_mask": None,
        "token_offsets": None,
        "features": None,
        "sampling_params": sampling,
        "model": req.model,
        "stream": req.stream,
        "stream_options": body.get("stream_options"),
        "cache_salt": req.cache_salt,
        "priority": body.get("priority", 0),
        "kv_transfer_params": body.get("kv_transfer_params"),
    }
