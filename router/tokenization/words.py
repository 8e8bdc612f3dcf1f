"""The emulator's deterministic word tokenizer.

Every whitespace-separated word is one token whose id is a hash of the word, so the
router and the emulator turn the same text into the same ids without sharing state,
and a prompt of N words is exactly N tokens (which lets workloads size prompts in
tokens while sending text). Ids below ``FIRST_WORD_ID`` are reserved for the chat
markers below, so markers never collide with words. A media content part (an image,
audio or video) renders as ``placeholder_tokens`` copies of its modality's marker, like
the placeholder tokens a multimodal model's processor inserts.

Decoding is best effort: ids of the generation vocabulary and of words this process
has encoded map back to their words; other ids render as ``<id>``.

Long texts are encoded in chunks cut at whitespace (every ``CHUNK_CHARS`` characters,
at the first whitespace from there), and the ids of recent chunks are remembered: a
word never spans a cut, so the ids are exactly those of the whole text, and prompts
that share a prefix (a system prompt, a document, earlier turns) find its chunks
already encoded, as their cuts fall at the same places.

A tokenizer made with ``decodes=False`` (the router's: it never turns ids back into
words) encodes ASCII text in one call of the compiled helper ``router._native`` when the
install built it (router/native/native.c, the same ids: tests/unit/test_word_chunks.py),
and so does not remember the words it met.
"""

from __future__ import annotations

import re
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import xxhash

from router.hashing import native_helper
from router.media import DEFAULT_MM_PLACEHOLDER_TOKENS, MediaSpan, media_item

VOCAB_SIZE = 131_072
FIRST_WORD_ID = 1_024
_WORD_SPAN = VOCAB_SIZE - FIRST_WORD_ID
_MAX_REMEMBERED = 200_000
CHUNK_CHARS = 512
"""Texts longer than twice this are encoded in chunks of about this many characters."""
CHUNKS_REMEMBERED = 4_096
"""Encoded chunks kept (least recently used out)..."""
CHUNK_CHARS_HELD = 4 * 1024 * 1024
"""...and at most this many characters of them (a chunk runs past ``CHUNK_CHARS`` only to
the end of a long word)."""
# Whitespace as str.split() sees it (re's \s is Py_UNICODE_ISSPACE for str patterns).
_SPACE = re.compile(r"\s")

# Chat markers, one token each: they are not produced by splitting ordinary text.
ROLE_MARKERS = {
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "tool": "<|tool|>",
    "developer": "<|developer|>",
}
END_MARKER = "<|end|>"
MEDIA_MARKERS = {"image": "<|image|>", "audio": "<|audio|>", "video": "<|video|>"}
_MARKER_IDS = {
    m: i + 1 for i, m in enumerate([*ROLE_MARKERS.values(), END_MARKER, *MEDIA_MARKERS.values()])
}

# fmt: off
_SYLLABLES = (
    "ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa",
    "do", "fi", "gu", "he", "jo", "ba", "qi", "wu", "xe", "yo",
)
# fmt: on


_NATIVE_WORD_IDS: Any = getattr(native_helper(), "word_ids", None)
"""The compiled helper's ``word_ids``, or None (not built, or ``KVROUTE_PURE_PYTHON=1``)."""
_NATIVE_PACKED: Any = getattr(native_helper(), "word_ids_packed", None)
"""Its ``word_ids_packed`` (the same ids as native uint32 bytes), or None."""


def _generation_words(count: int = 1_000) -> list[str]:
    words: list[str] = []
    n = len(_SYLLABLES)
    for i in range(count):
        a, b, c = i % n, (i // n) % n, (i // (n * n)) % n
        words.append(_SYLLABLES[a] + _SYLLABLES[b] + (_SYLLABLES[c] if c else ""))
    return words


def word_id(word: str) -> int:
    """The token id of one word (markers have fixed small ids)."""
    marker = _MARKER_IDS.get(word)
    if marker is not None:
        return marker
    digest = xxhash.xxh32_intdigest(word.encode("utf-8", "surrogatepass"))
    return FIRST_WORD_ID + digest % _WORD_SPAN


_xxh32 = xxhash.xxh32_intdigest


class _Vocab(dict[str, int]):
    """word -> id with the ids of recently seen words remembered for decoding."""

    def __init__(self, names: Mapping[int, str]) -> None:
        super().__init__(_MARKER_IDS)  # so a word missing here is never a marker
        self.names: dict[int, str] = dict(names)

    def __missing__(self, word: str) -> int:
        tid = FIRST_WORD_ID + _xxh32(word.encode("utf-8", "surrogatepass")) % _WORD_SPAN
        if len(self) < _MAX_REMEMBERED:
            self[word] = tid
            self.names.setdefault(tid, word)
        return tid


class WordTokenizer:
    """Deterministic word-level tokenizer shared by kvroute and its engine emulator."""

    vocab_size = VOCAB_SIZE

    def __init__(self, decodes: bool = True) -> None:
        """``decodes``: whether :meth:`decode` must know the words this tokenizer encoded
        (the emulator's); without it, ASCII text takes the compiled helper when built."""
        self._native = None if decodes else _NATIVE_WORD_IDS
        self._packed = None if decodes else _NATIVE_PACKED
        self.generation_words = _generation_words()
        names = {word_id(w): w for w in self.generation_words}
        names.update({i: m for m, i in _MARKER_IDS.items()})
        self._vocab = _Vocab(names)
        self.generation_ids = [word_id(w) for w in self.generation_words]
        self._chunks: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chunk_chars = 0

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: one per whitespace-separated word."""
        native = self._native
        if native is not None:
            ids = native(text, _MARKER_IDS, FIRST_WORD_ID, _WORD_SPAN)
            if ids is not None:
                return ids  # type: ignore[no-any-return]
        lookup = self._vocab.__getitem__
        if len(text) <= 2 * CHUNK_CHARS:
            return list(map(lookup, text.split()))
        ids: list[int] = []
        chunks = self._chunks
        start, end = 0, len(text)
        while True:
            # Any whitespace is a valid cut: a space within the next chunk's length when
            # there is one (str.find is cheaper than the pattern), else the first
            # whitespace there, else (one long word) the first whitespace after it.
            lo = start + CHUNK_CHARS
            cut = text.find(" ", lo, lo + CHUNK_CHARS)
            if cut < 0:
                space = _SPACE.search(text, lo, lo + CHUNK_CHARS) or _SPACE.search(text, lo)
                cut = end if space is None else space.start()
            if end - cut < CHUNK_CHARS:
                ids.extend(map(lookup, text[start:].split()))
                return ids
            piece = text[start:cut]
            known = chunks.get(piece)
            if known is None:
                known = chunks[piece] = tuple(map(lookup, piece.split()))
                self._chunk_chars += len(piece)
                while len(chunks) > CHUNKS_REMEMBERED or self._chunk_chars > CHUNK_CHARS_HELD:
                    gone, _ = chunks.popitem(last=False)
                    self._chunk_chars -= len(gone)
            else:
                chunks.move_to_end(piece)
            ids.extend(known)
            start = cut

    def ids(self, text: str) -> Sequence[int]:
        """:meth:`encode`'s ids for reading only: packed in an ``array('I')`` when the
        compiled helper encodes ``text`` (no int object per word, and block hashing
        reads the array's buffer as it is), else :meth:`encode`'s list."""
        packed = self._packed
        if packed is not None:
            raw = packed(text, _MARKER_IDS, FIRST_WORD_ID, _WORD_SPAN)
            if raw is not None:
                ids = array("I")
                ids.frombytes(raw)
                return ids
        return self.encode(text)

    def count(self, text: str) -> int:
        return len(text.split())

    def decode(self, ids: Iterable[int]) -> str:
        names = self._vocab.names
        return " ".join(names.get(i) or f"<{i}>" for i in ids)

    def token_str(self, tid: int) -> str:
        return self._vocab.names.get(tid) or f"<{tid}>"

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        return render_chat(messages, add_generation_prompt)


def message_text(content: Any) -> str:
    """The text of an OpenAI message ``content``: a string or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
        return " ".join(parts)
    raise ValueError("message content must be a string or a list of content parts")


def _part_text(part: Any) -> str:
    """The text of one content part ('' for media and unknown parts)."""
    if isinstance(part, str):
        return part
    if isinstance(part, Mapping) and part.get("type") == "text":
        return str(part.get("text", ""))
    return ""


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    placeholder_tokens: int = DEFAULT_MM_PLACEHOLDER_TOKENS,
) -> str:
    """Render OpenAI chat messages into the emulator's prompt text.

    Each message becomes ``<|role|> content <|end|>``; the generation prompt appends
    ``<|assistant|>``. An assistant answer appended to a conversation therefore
    tokenizes exactly as the engine generated it, so multi-turn prefixes match.
    """
    return render_chat_media(messages, add_generation_prompt, placeholder_tokens)[0]


def render_chat_media(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    placeholder_tokens: int = DEFAULT_MM_PLACEHOLDER_TOKENS,
) -> tuple[str, list[MediaSpan]]:
    """:func:`render_chat`'s text and where each media item's placeholders sit in its
    tokens. Media parts render in place, ``placeholder_tokens`` markers each (at least 1).
    Raises ValueError for an unknown role or a media part without data."""
    if placeholder_tokens < 1:
        raise ValueError("placeholder_tokens must be at least 1")
    pieces: list[str] = []
    spans: list[MediaSpan] = []
    position = 0
    # Only content-part lists can hold media: string-only chats skip the word counts.
    counting = any(isinstance(msg.get("content"), list) for msg in messages)

    def add(text: str) -> None:
        nonlocal position
        pieces.append(text)
        if counting:
            position += len(text.split())

    for msg in messages:
        role = msg.get("role")
        marker = ROLE_MARKERS.get(role) if isinstance(role, str) else None
        if marker is None:
            raise ValueError(f"unknown chat role {role!r}")
        add(marker)
        content = msg.get("content")
        if isinstance(content, list):
            for part in content:
                item = media_item(part)
                if item is not None:
                    spans.append(MediaSpan(item.identifier, position, placeholder_tokens))
                    add(" ".join([MEDIA_MARKERS[item.modality]] * placeholder_tokens))
                elif text := _part_text(part):
                    add(text)
        elif text := message_text(content):
            add(text)
        add(END_MARKER)
    if add_generation_prompt:
        add(ROLE_MARKERS["assistant"])
    return " ".join(pieces), spans
