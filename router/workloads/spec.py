"""The request a workload sends, and the tokens an emulated engine sees for it.

A :class:`RequestSpec` is what the live benchmark sends and the simulator replays, so
the two run the same requests; :func:`spec_tokens` and :func:`answer_tokens` tokenize
as the engine emulator does (its word tokenizer).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.tokenization.words import WordTokenizer, render_chat


@dataclass(slots=True)
class RequestSpec:
    """One request to send."""

    prompt: str | list[int] | array | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int = 16
    group: str = ""
    """A label results are grouped by (a shared-prefix group, a conversation)."""
    at: float | None = None
    """Seconds after the run starts to send it (None: as soon as a slot is free)."""
    extra: dict[str, Any] = field(default_factory=dict)
    then: Callable[[str], RequestSpec | None] | None = None
    """Builds the next request of the same session from this one's answer text."""
    delay: float = 0.0
    """Seconds to wait after the previous request of its session ended (think time)."""


_tokenizer = WordTokenizer()


def spec_tokens(spec: RequestSpec) -> list[int]:
    """The prompt token ids an emulated engine sees for ``spec`` (word tokenizer)."""
    if spec.messages is not None:
        return _tokenizer.encode(render_chat(spec.messages))
    if isinstance(spec.prompt, str):
        return _tokenizer.encode(spec.prompt)
    return list(spec.prompt or [])


def answer_tokens(text: str) -> list[int]:
    """The token ids of an answer, as the emulator generated them."""
    return _tokenizer.encode(text)
