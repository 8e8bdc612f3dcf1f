"""The client APIs ``kvroute bench`` can drive (``--api``): how a request spec becomes a
request, and what an answer says (text, prompt and cached tokens), one class per API
and one line in :data:`APIS`.

* ``openai``: ``/v1/completions`` for a prompt, ``/v1/chat/completions`` for messages
  (a stream asks for usage in its last chunk).
* ``responses``: ``/v1/responses``, the prompt as ``input`` text or the messages as
  input items; text from ``response.output_text.delta`` events, usage from
  ``response.completed`` (``input_tokens``, ``input_tokens_details.cached_tokens``).
"""

from __future__ import annotations

from typing import Any, Protocol

from router.bench import messages
from router.workloads.spec import RequestSpec


class Usage(Protocol):
    """Where an answer's counts go (the load generator's per-request result)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class BenchApi(Protocol):
    """One client API of the load generator."""

    def request(
        self, spec: RequestSpec, *, stream: bool, model: str | None
    ) -> tuple[str, dict[str, Any]]:
        """The path and JSON body of ``spec``."""
        ...

    def answer(self, usage: Usage, payload: dict[str, Any]) -> str:
        """A whole JSON answer: its text; its counts go into ``usage``."""
        ...

    def event(self, usage: Usage, payload: dict[str, Any]) -> str | None:
        """One streamed event's JSON: its text, if it carries some; counts into ``usage``."""
        ...


def _count(value: Any) -> int:
    return int(value or 0) if isinstance(value, (int, float)) else 0


class OpenAIApi:
    """Completions and chat completions."""

    def request(
        self, spec: RequestSpec, *, stream: bool, model: str | None
    ) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"max_tokens": spec.max_tokens, "stream": stream, **spec.extra}
        if model is not None:
            body["model"] = model
        if spec.messages is not None:
            body["messages"] = spec.messages
        else:
            body["prompt"] = spec.prompt
        if stream:
            body["stream_options"] = {"include_usage": True}
        return ("/v1/chat/completions" if spec.messages is not None else "/v1/completions"), body

    def _usage(self, usage: Usage, counts: Any) -> None:
        if not isinstance(counts, dict):
            return
        usage.prompt_tokens = _count(counts.get("prompt_tokens"))
        usage.completion_tokens = _count(counts.get("completion_tokens"))
        details = counts.get("prompt_tokens_details") or {}
        usage.cached_tokens = _count(details.get("cached_tokens"))

    def answer(self, usage: Usage, payload: dict[str, Any]) -> str:
        self._usage(usage, payload.get("usage"))
        choice = (payload.get("choices") or [{}])[0]
        return choice.get("text") or (choice.get("message") or {}).get("content") or ""

    def event(self, usage: Usage, payload: dict[str, Any]) -> str | None:
        self._usage(usage, payload.get("usage"))
        pieces = []
        for choice in payload.get("choices") or []:
            text = choice.get("text")
            if text is None:
                text = (choice.get("delta") or {}).get("content")
            if text:
                pieces.append(text)
        return "".join(pieces) or None


class ResponsesApi:
    """The OpenAI Responses API."""

    def request(
        self, spec: RequestSpec, *, stream: bool, model: str | None
    ) -> tuple[str, dict[str, Any]]:
        if spec.messages is None and not isinstance(spec.prompt, str):
            raise ValueError("the Responses API takes text prompts, not token ids")
        body: dict[str, Any] = {
            "input": spec.messages if spec.messages is not None else spec.prompt,
            "max_output_tokens": spec.max_tokens,
            "stream": stream,
            **spec.extra,
        }
        if model is not None:
            body["model"] = model
        return "/v1/responses", body

    def _usage(self, usage: Usage, response: Any) -> None:
        counts = response.get("usage") if isinstance(response, dict) else None
        if not isinstance(counts, dict):
            return
        usage.prompt_tokens = _count(counts.get("input_tokens"))
        usage.completion_tokens = _count(counts.get("output_tokens"))
        details = counts.get("input_tokens_details") or {}
        usage.cached_tokens = _count(details.get("cached_tokens"))

    def answer(self, usage: Usage, payload: dict[str, Any]) -> str:
        self._usage(usage, payload)
        return "".join(
            part.get("text") or ""
            for item in payload.get("output") or []
            if item.get("type") == "message"
            for part in item.get("content") or []
        )

    def event(self, usage: Usage, payload: dict[str, Any]) -> str | None:
        kind = payload.get("type")
        if kind == "response.output_text.delta":
            return str(payload.get("delta") or "") or None
        if kind == "response.completed":
            self._usage(usage, payload.get("response"))
        return None


class MessagesApi:
    """Anthropic Messages (:mod:`router.bench.messages`)."""

    def request(
        self, spec: RequestSpec, *, stream: bool, model: str | None
    ) -> tuple[str, dict[str, Any]]:
        return messages.request_body(spec, stream=stream, model=model)

    def answer(self, usage: Usage, payload: dict[str, Any]) -> str:
        messages.take_usage(usage, payload.get("usage"))  # type: ignore[arg-type]
        return messages.answer_text(payload)

    def event(self, usage: Usage, payload: dict[str, Any]) -> str | None:
        return messages.event_text(usage, payload)  # type: ignore[arg-type]


APIS: dict[str, BenchApi] = {
    "openai": OpenAIApi(),
    "responses": ResponsesApi(),
    "messages": MessagesApi(),
}
"""``--api`` name -> the API."""
