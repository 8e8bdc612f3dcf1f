"""What every front end refuses: one set of request checks for the HTTP API, gRPC
``Pick`` and ``Generate``, and Envoy ext_proc.

A front end parses the request (:mod:`router.serving.parsing`), then calls
:func:`check_request` (the ``limits.*`` bounds on what it asks for, then its model or
LoRA adapter), then tokenizes it (:meth:`~router.serving.decide.Decider.prepare`), then
calls :func:`check_prompt_tokens` (the prompt-token bound needs the token ids). A gRPC
``Pick`` given precomputed block keys has no body: :func:`check_keyed` applies the same
bounds to its fields.

A refusal is :class:`InvalidRequest`, an :class:`~router.serving.errors.ApiError`, so each
front end answers it as it answers any refusal: the HTTP API with its status (400, 404
for an unknown model) and OpenAI error JSON, gRPC with the matching status code
(``INVALID_ARGUMENT``, ``NOT_FOUND``) and the same message, ext_proc with an
``ImmediateResponse`` of the same status and JSON.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.config import LimitsConfig
from router.serving.errors import ApiError
from router.serving.parsing import MIN_OUTPUT_TOKENS, ParsedRequest, optional_int, prompt_param


class InvalidRequest(ApiError):
    """A request this router refuses on every front end.

    ``reason`` names the rule it broke: the ``limits.*`` key (``max_n``,
    ``max_output_tokens``, ``max_prompts``, ``max_sequences``, ``max_prompt_tokens``),
    ``model_required`` or ``model_not_found``.
    """

    def __init__(
        self,
        message: str,
        reason: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(status, message, param=param, code=code)
        self.reason = reason


def check_request(parsed: ParsedRequest, limits: LimitsConfig, served: Sequence[str]) -> str:
    """The model to route ``parsed`` for, once its bounds are checked (before
    tokenizing, so an oversized request costs no tokenizer time)."""
    check_limits(parsed, limits)
    return resolve_model(parsed.model, served)


def check_limits(parsed: ParsedRequest, limits: LimitsConfig) -> None:
    """Bounds on what a request may ask for (before any routing or tokenizing)."""
    _check_n(parsed.n, limits)
    _check_output("max_tokens", parsed.max_tokens, limits)
    _check_output("max_completion_tokens", parsed.max_completion_tokens, limits)
    _check_output("max_output_tokens", parsed.max_output_tokens, limits)
    count = len(parsed.texts) if parsed.texts is not None else len(parsed.messages or ())
    if count > limits.max_prompts:
        what = "prompts" if parsed.texts is not None else "messages"
        raise InvalidRequest(
            f"at most {limits.max_prompts} {what} per request, got {count}",
            "max_prompts",
            param=prompt_param(parsed),
        )
    _check_sequences((count if parsed.texts is not None else 1) * parsed.n, limits)


def check_prompt_tokens(parsed: ParsedRequest, limits: LimitsConfig) -> None:
    """The tokenized prompts stay within ``limits.max_prompt_tokens`` (each)."""
    longest = max((len(p) for p in parsed.prompts), default=0)
    _check_prompt_length(longest, prompt_param(parsed), limits)


def check_keyed(n: int, max_tokens: int | None, prompt_tokens: int, limits: LimitsConfig) -> None:
    """The same bounds for a request given as block keys (one prompt of
    ``prompt_tokens`` tokens)."""
    _check_n(n, limits)
    optional_int({"max_tokens": max_tokens}, "max_tokens", MIN_OUTPUT_TOKENS)  # as a body's
    _check_output("max_tokens", max_tokens, limits)
    _check_sequences(n, limits)
    _check_prompt_length(prompt_tokens, "block_keys", limits)


def resolve_model(requested: str | None, served: Sequence[str]) -> str:
    """The model to route for: the requested one (a model or LoRA adapter) if served,
    the only one if omitted."""
    if not served:  # no engine reached yet: not the client's mistake
        raise ApiError(
            503,
            "no engine serves any model yet (engines unreachable or still starting)",
            retry_after=1,
        )
    if requested is None:
        if len(served) == 1:
            return served[0]
        raise InvalidRequest(
            "'model' is required when several models are served", "model_required", param="model"
        )
    if requested not in served:
        listed = ", ".join(served) or "none"
        raise InvalidRequest(
            f"The model '{requested}' does not exist. Served models: {listed}",
            "model_not_found",
            status=404,
            param="model",
            code="model_not_found",
        )
    return requested


def _check_n(n: int, limits: LimitsConfig) -> None:
    if n > limits.max_n:
        raise InvalidRequest(f"'n' must be at most {limits.max_n}", "max_n", param="n")


def _check_output(name: str, value: int | None, limits: LimitsConfig) -> None:
    if value is not None and value > limits.max_output_tokens:
        raise InvalidRequest(
            f"'{name}' must be at most {limits.max_output_tokens}", "max_output_tokens", param=name
        )


def _check_sequences(sequences: int, limits: LimitsConfig) -> None:
    if sequences > limits.max_sequences:
        raise InvalidRequest(
            f"this request asks for {sequences} sequences (prompts x 'n'); this router "
            f"accepts at most {limits.max_sequences}",
            "max_sequences",
            param="n",
        )


def _check_prompt_length(tokens: int, param: str, limits: LimitsConfig) -> None:
    if tokens > limits.max_prompt_tokens:
        raise InvalidRequest(
            f"the prompt has {tokens} tokens; this router accepts at most "
            f"{limits.max_prompt_tokens}",
            "max_prompt_tokens",
            param=param,
            code="context_length_exceeded",
        )
