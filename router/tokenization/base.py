"""The tokenizer interface routing uses.

Every mode turns a prompt (text, or chat messages) into token ids, so block keys are
computed one way for all of them. Only ``exact`` tokenizers produce the ids the engine
itself uses; their keys match the keys the router derives from the engine's KV events.

A chat with media parts (images, audio, video) also yields where each item's placeholder
tokens sit (:meth:`PromptTokenizer.chat_prompt`), so that block keys fold the items in
from the block holding their first placeholder on (``router.media``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
import xxhash

from router.media import MediaError, MediaItem, MediaSpan, message_media


class TokenizeError(ValueError):
    """The prompt cannot be tokenized (a bad chat message, a template error): a 400."""


class TokenizerUnavailable(RuntimeError):
    """The tokenizer cannot answer now (its engine is unreachable): route on load alone."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        """The engine's HTTP status, when it answered."""


def media_by_message(messages: Sequence[Mapping[str, Any]]) -> dict[int, list[MediaItem]]:
    """The media items of a chat per message index (TokenizeError for a bad media part)."""
    found: dict[int, list[MediaItem]] = {}
    try:
        for index, item in message_media(messages):
            found.setdefault(index, []).append(item)
    except MediaError as exc:
        raise TokenizeError(str(exc)) from None
    return found


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two token lists share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RecentPrompts:
    """Token ids of recent inputs, for tokenizers whose answer depends on the input
    alone (the same text, or the same chat, gives the same ids), so a prompt sent again
    is not tokenized again. Keyed by a 128-bit hash of the input; least recently used out,
    bounded by ``max_tokens`` held (4 bytes each) and by ``max_entries``."""

    def __init__(self, max_tokens: int, max_entries: int = 16_384) -> None:
        self.max_tokens = max_tokens
        self.max_entries = max_entries
        self.tokens = 0
        self.hits = 0
        self.misses = 0
        self._held: OrderedDict[bytes, array[int]] = OrderedDict()

    @staticmethod
    def text_key(kind: bytes, text: str) -> bytes:
        return kind + xxhash.xxh3_128_digest(text.encode("utf-8", "surrogatepass"))

    @staticmethod
    def chat_key(
        kind: bytes,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None,
    ) -> bytes | None:
        """None for a chat that is not plain JSON (it is then not remembered)."""
        try:
            raw = msgspec.json.encode([messages, add_generation_prompt, template_kwargs])
        except (TypeError, msgspec.EncodeError):
            return None
        return kind + xxhash.xxh3_128_digest(raw)

    def get(self, key: bytes | None) -> list[int] | None:
        if key is None or not self.max_tokens:
            return None
        held = self._held.get(key)
        if held is None:
            self.misses += 1
            return None
        self.hits += 1
        self._held.move_to_end(key)
        return held.tolist()  # a new list each time: callers may change theirs

    def put(self, key: bytes | None, ids: Sequence[int]) -> None:
        if key is None or not self.max_tokens or len(ids) > self.max_tokens:
            return
        try:
            packed = array("I", ids)
        except OverflowError:  # an id outside uint32: leave it to the caller's checks
            return
        previous = self._held.pop(key, None)
        if previous is not None:
            self.tokens -= len(previous)
        self._held[key] = packed
        self.tokens += len(packed)
        while self.tokens > self.max_tokens or len(self._held) > self.max_entries:
            _, gone = self._held.popitem(last=False)
            self.tokens -= len(gone)

    def __len__(self) -> int:
        return len(self._held)


@dataclass(slots=True)
class ChatPrompt:
    """A tokenized chat and the placeholder spans of its media items, in prompt order."""

    tokens: list[int]
    media: list[MediaSpan] = field(default_factory=list)


class PromptTokenizer(ABC):
    """Turns prompts into the token ids routing hashes."""

    mode: ClassVar[str]
    exact: ClassVar[bool] = True
    """Whether these are the engine's own token ids (so KV events can confirm them)."""
    media_exact: ClassVar[bool] = True
    """Whether a chat with media parts has as many tokens here as at the engine (so the
    mismatch guard may compare them)."""

    @abstractmethod
    async def prompt(self, text: str) -> Sequence[int]:
        """Token ids of a completion prompt, special tokens included as the engine adds them
        (for reading: a list, or an ``array('I')`` where that is cheaper to make)."""

    @abstractmethod
    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a chat rendered with the model's template."""

    async def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> ChatPrompt:
        """A chat's tokens and media spans. This default places every media item at the
        prompt's first token: the keys of a chat with media then share nothing with
        other chats', never a false match; modes that know better override it."""
        tokens = await self.chat(messages, add_generation_prompt, template_kwargs)
        media = media_by_message(messages)
        spans = [MediaSpan(item.identifier, 0, 1) for items in media.values() for item in items]
        return ChatPrompt(tokens, spans)

    async def requires_system_first(self) -> bool:
        """Whether the model's template refuses a system message after the first one
        (vLLM then merges them into the leading one, :mod:`router.tokenization.anthropic`)."""
        return False

    async def responses(
        self,
        request: Mapping[str, Any],
        messages: Sequence[Mapping[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a Responses request (``request``: its body without conversation
        state; ``messages``: the chat it renders from,
        :func:`router.tokenization.responses_input.responses_messages`). By default the chat's."""
        return await self.chat(messages, True, template_kwargs)
