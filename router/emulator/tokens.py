"""The emulator's tokens-in, tokens-out route, ``POST /inference/v1/generate``, served as
vLLM 0.32 serves it (with ``--enable-scale-out``; output mode ``tokens`` only).

A body names its prompt as ``token_ids`` and its sampling as ``sampling_params``
(``max_tokens``, ``min_tokens``, ``seed``, ``stop_token_ids``, ``extra_args``). As in
vLLM, the connector parameters the engine acts on are ``SamplingParams.extra_args``:
``sampling_params.extra_args["kv_transfer_params"]`` as the client sent it, overridden
by a top-level ``kv_transfer_params`` (``vllm/v1/request.py`` reads extra_args), so a
NIXL handoff named in either place runs. The request runs as a completion of those
tokens; the answer is ``{request_id: "generate-tokens-ID", choices: [{index, token_ids,
finish_reason, stop_reason, logprobs}], usage, kv_transfer_params}``, or streamed, one
``data:`` chunk per step with the step's ``token_ids``, a usage chunk with
``stream_options.include_usage``, then ``data: [DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.emulator.generation import Generation, sse
from router.emulator.messages import Generate
from router.emulator.protocol import APIError, parse_body
from router.engine_model import RequestOutput

#: ``sampling_params`` fields the emulator applies, as completion fields.
_SAMPLING = ("max_tokens", "min_tokens", "seed", "stop_token_ids")


def _invalid(message: str, field: str) -> APIError:
    return APIError(400, message, f"body.{field}", "Bad Request")


def completion_body(body: dict[str, Any]) -> dict[str, Any]:
    """The completion body a generate body runs as (400 for what vLLM's request model
    refuses)."""
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids:
        raise _invalid("token_ids: a non-empty list of token ids is required", "token_ids")
    sampling = body.get("sampling_params")
    if not isinstance(sampling, dict):
        raise _invalid("Field required: sampling_params", "sampling_params")
    extra = sampling.get("extra_args")
    if extra is not None and not isinstance(extra, dict):
        raise _invalid("sampling_params.extra_args must be an object", "sampling_params")
    completion: dict[str, Any] = {"prompt": ids, "stream": body.get("stream") is True}
    completion.update({k: sampling[k] for k in _SAMPLING if sampling.get(k) is not None})
    for name in ("model", "cache_salt", "stream_options"):
        if body.get(name) is not None:
            completion[name] = body[name]
    params = body.get("kv_transfer_params")
    if params is None and extra is not None:
        params = extra.get("kv_transfer_params")
    if params is not None:
        completion["kv_transfer_params"] = params
    return completion


class TokensGeneration(Generation):
    """A generate request's generation: the completion one, answered with token ids."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.response_id = f"generate-tokens-{self.base_id}"
        self.tokens: list[list[int]] = [[] for _ in self.specs]

    def _take(self, index: int, out: RequestOutput) -> str:
        self.tokens[index] += out.new_token_ids
        return super()._take(index, out)

    async def collect(self) -> dict[str, Any]:
        while not self.finished:
            index, out = await self.queue.get()
            self._take(index, out)
        choices = []
        for index, (ids, end) in enumerate(zip(self.tokens, self.ends, strict=True)):
            assert end is not None
            choices.append(
                {
                    "index": index,
                    "finish_reason": end.finish_reason or "stop",
                    "stop_reason": end.stop_reason,
                    "token_ids": ids,
                    "logprobs": None,
                }
            )
        return {
            "request_id": self.response_id,
            "model": self.req.model,
            "created": self.created,
            "usage": self.usage(),
            "kv_transfer_params": self.handoff.params() if self.handoff is not None else None,
            "output_mode": "tokens",
            "choices": choices,
        }

    async def events(self) -> AsyncIterator[tuple[bytes, int]]:
        while not self.finished:
            index, out = await self.queue.get()
            self._take(index, out)
            choice = {
                "index": index,
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
                "token_ids": out.new_token_ids,
                "logprobs": None,
            }
            chunk = {"request_id": self.response_id, "output_mode": "tokens", "choices": [choice]}
            yield sse(chunk), len(out.new_token_ids)
        if self.req.include_usage:
            final = {"request_id": self.response_id, "choices": [], "usage": self.usage()}
            yield sse({**final, "output_mode": "tokens"}), 0
        yield b"data: [DONE]\n\n", 0


def routes(generate: Generate) -> list[Route]:
    """``/inference/v1/generate`` over ``generate``."""

    async def tokens(request: Request) -> Response:
        body = completion_body(parse_body(await request.body()))
        return await generate(request, False, body, TokensGeneration)

    return [Route("/inference/v1/generate", tokens, methods=["POST"])]
