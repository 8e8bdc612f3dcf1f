"""``kvroute bench --api messages``: a workload's requests as Anthropic Messages.

A chat spec's leading system message becomes ``system``, its other messages stay (an
answer text appended by a conversation's next turn included); a completion spec's
prompt becomes one user message. The answer's ``usage`` counts cached tokens apart
(``input_tokens`` + ``cache_read_input_tokens`` is the prompt), so the hit rate is
the same measure as on the OpenAI routes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.bench.loadgen import Result
    from router.workloads.spec import RequestSpec

PATH = "/v1/messages"


def request_body(
    spec: RequestSpec, *, stream: bool, model: str | None = None
) -> tuple[str, dict[str, Any]]:
    """The path and body of ``spec`` as a Messages request."""
    body: dict[str, Any] = {"max_tokens": spec.max_tokens, "stream": stream, **spec.extra}
    if model is not None:
        body["model"] = model
    messages = list(spec.messages or [{"role": "user", "content": spec.prompt}])
    if messages and messages[0].get("role") == "system":
        body["system"] = messages.pop(0)["content"]
    body["messages"] = messages
    return PATH, body


def take_usage(result: Result, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    cached = int(usage.get("cache_read_input_tokens") or 0)
    created = int(usage.get("cache_creation_input_tokens") or 0)
    result.prompt_tokens = int(usage.get("input_tokens") or 0) + cached + created
    result.completion_tokens = int(usage.get("output_tokens") or 0)
    result.cached_tokens = cached


def answer_text(payload: dict[str, Any]) -> str:
    """The text of a whole ``message`` answer."""
    blocks = payload.get("content") or []
    return "".join(b.get("text") or "" for b in blocks if isinstance(b, dict))


def event_text(result: Result, payload: dict[str, Any]) -> str | None:
    """One streamed event: its text delta, if any (usage and errors go into ``result``)."""
    kind = payload.get("type")
    if kind == "message_start":
        take_usage(result, (payload.get("message") or {}).get("usage"))
    elif kind == "message_delta":
        take_usage(result, payload.get("usage"))
    elif kind == "error":
        result.error = str((payload.get("error") or {}).get("message", "stream error"))
    elif kind == "content_block_delta":
        return (payload.get("delta") or {}).get("text") or None
    return None
