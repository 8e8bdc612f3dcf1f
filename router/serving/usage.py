"""Reading and rewriting the ``usage`` object of an engine's answer on its way through.

A disaggregated request's decode leg reports its own cached tokens (SGLang's counts the
pushed KV as cached), but the client must see what the cache saved at prefill, in
either dialect; the router also reads the decode leg's usage to
detect a handoff the engine silently replaced by a local prefill. A stream carries usage
in one event near its end, and only that event (the one holding
``prompt_tokens_details``) is parsed. Anthropic's ``usage`` counts a prompt's cached
tokens apart (:func:`engine_input_tokens`), and a Messages stream reports it in its first
event (:func:`stream_input_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec

_decode = msgspec.json.decode
_encode = msgspec.json.encode
_MARK = b'"prompt_tokens_details"'


def cached_tokens(answer: Mapping[str, Any]) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a whole JSON answer, if any."""
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    value = details.get("cached_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def engine_input_tokens(usage: Mapping[str, Any]) -> int | None:
    """The prompt tokens an engine's Anthropic ``usage`` reports, cached ones included."""
    total = 0
    for name in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
        value = usage.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            return None
        total += value
    return total if "input_tokens" in usage else None


def stream_input_tokens(first: bytes) -> int | None:
    """The prompt tokens in a stream's ``message_start`` event (its first), if there."""
    start = first.find(b"data:")
    if not first.startswith(b"event: message_start") or start == -1:
        return None
    try:
        event = _decode(first[start + 5 :].split(b"\n", 1)[0])
    except msgspec.DecodeError:
        return None
    message = event.get("message") if isinstance(event, dict) else None
    usage = message.get("usage") if isinstance(message, dict) else None
    return engine_input_tokens(usage) if isinstance(usage, dict) else None


def carries_usage(chunk: bytes) -> bool:
    """Whether part of a stream may hold the usage event (the one a tap rewrites)."""
    return _MARK in chunk


class UsageTap:
    """Sees an answer's usage, optionally overriding ``cached_tokens`` or hiding it."""

    def __init__(
        self,
        on_usage: Callable[[dict[str, Any]], None] | None = None,
        cached_tokens: int | None = None,
        drop_usage_event: bool = False,
    ) -> None:
        self.on_usage = on_usage
        self.cached_tokens = cached_tokens
        self.drop_usage_event = drop_usage_event

    def _usage(self, obj: dict[str, Any]) -> bool:
        usage = obj.get("usage")
        if not isinstance(usage, dict):
            return False
        if self.on_usage is not None:
            self.on_usage(usage)
        if self.cached_tokens is not None:
            details = usage.get("prompt_tokens_details")
            if not isinstance(details, dict):
                details = usage["prompt_tokens_details"] = {}
            details["cached_tokens"] = self.cached_tokens
        return True

    def answer(self, body: bytes) -> bytes:
        """A whole JSON answer."""
        try:
            obj = _decode(body)
        except msgspec.DecodeError:
            return body
        if not isinstance(obj, dict) or not self._usage(obj):
            return body
        return _encode(obj)

    def chunk(self, chunk: bytes) -> bytes:
        """Part of an SSE stream; only an event holding the usage object is touched."""
        if _MARK not in chunk:
            return chunk
        events = chunk.split(b"\n\n")
        for i, event in enumerate(events):
            if _MARK not in event or not event.startswith(b"data: "):
                continue
            try:
                obj = _decode(event[6:])
            except msgspec.DecodeError:
                continue
            if not isinstance(obj, dict) or not self._usage(obj):
                continue
            if self.drop_usage_event and not obj.get("choices"):
                events[i] = b""
            else:
                events[i] = b"data: " + _encode(obj)
        return b"\n\n".join(e for e in events if e) + (b"\n\n" if chunk.endswith(b"\n\n") else b"")
