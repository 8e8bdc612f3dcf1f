"""Media items of chat prompts (images, audio, video): identifiers, placeholder spans,
and the per-block extra keys they add to block keys.

An engine caches the KV of a media item's placeholder tokens, and those tokens are the
same whatever the image: vLLM therefore hashes, with every block that holds placeholder
tokens, an ``(identifier, offset)`` pair per item overlapping the block (``offset``: where
the item starts, relative to the block's first token; negative for an item that began in
an earlier block). The router does the same (``router.hashing`` folds the pairs into the
block's key), so two prompts with the same text and different images share keys only
for the blocks before the first image.

An item's identifier is the client's ``uuid`` on the content part when given (what vLLM
uses as its multimodal hash when no processor kwargs change the item), else a digest of
the part's data: the URL (a ``data:`` URL holds the bytes themselves), the
``input_audio`` data and format, or the embeddings payload.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import xxhash

#: Content-part types that carry a media item, and the item's modality (vLLM's names).
MEDIA_PART_TYPES: dict[str, str] = {
    "image_url": "image",
    "input_image": "image",
    "image_embeds": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
    "video_embeds": "video",
}

#: Placeholder tokens per media item in the emulator and the ``words`` tokenizer unless
#: configured (``--mm-placeholder-tokens``, ``tokenizer.mm_placeholder_tokens``): a small
#: stand-in for a real processor's count (LLaVA-1.5 uses 576 per image).
DEFAULT_MM_PLACEHOLDER_TOKENS = 32

MediaKey = tuple[str, int]
"""One extra key of a block: (item identifier, item start relative to the block start)."""


class MediaError(ValueError):
    """A media content part of an unusable shape (a 400)."""


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One media content part: its modality and identifier."""

    modality: str
    identifier: str


@dataclass(frozen=True, slots=True)
class MediaSpan:
    """Where one media item's placeholder tokens sit in a tokenized prompt."""

    identifier: str
    offset: int
    """Index of the item's first placeholder token."""
    length: int
    """Placeholder tokens of the item (at least 1)."""


def _url(value: Any, part_type: str) -> str:
    """``{"url": ...}`` or a bare URL string (vLLM accepts both)."""
    if isinstance(value, Mapping):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise MediaError(f"a {part_type!r} content part needs a non-empty URL")
    return value


def _payload(part: Mapping[str, Any], part_type: str) -> bytes:
    if part_type.endswith("_embeds"):
        return msgspec.json.encode(part.get(part_type))
    if part_type == "input_audio":
        audio = part.get("input_audio")
        if not isinstance(audio, Mapping) or not isinstance(audio.get("data"), str):
            raise MediaError("an 'input_audio' content part needs 'data' (base64) and 'format'")
        return f"{audio.get('format')}\x00{audio['data']}".encode()
    value = part.get(part_type)
    if part_type == "input_image":  # the Responses API's shape: a bare image_url string
        value = part.get("image_url")
    return _url(value, part_type).encode("utf-8", "surrogatepass")


def digest(modality: str, data: bytes) -> str:
    """The router's identifier of an item without a client ``uuid``: a 128-bit digest
    of its modality and data, in hex."""
    hasher = xxhash.xxh3_128()
    hasher.update(modality.encode())
    hasher.update(b"\x00")
    hasher.update(data)
    return hasher.hexdigest()


def media_item(part: Any) -> MediaItem | None:
    """The media item a content part carries; None for text parts and plain strings.

    Raises MediaError for a media part without its data (and without a ``uuid``).
    """
    if not isinstance(part, Mapping):
        return None
    part_type = part.get("type")
    if part_type is None:  # vLLM also reads untyped parts by the field they hold
        part_type = next((t for t in MEDIA_PART_TYPES if t in part), None)
    modality = MEDIA_PART_TYPES.get(part_type) if isinstance(part_type, str) else None
    if modality is None:
        return None
    uuid = part.get("uuid")
    if uuid is not None:
        return MediaItem(modality, str(uuid))
    return MediaItem(modality, digest(modality, _payload(part, part_type)))


def message_media(messages: Sequence[Mapping[str, Any]]) -> Iterator[tuple[int, MediaItem]]:
    """(message index, item) of every media part of a chat, in order."""
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if isinstance(content, list):
            for part in content:
                item = media_item(part)
                if item is not None:
                    yield i, item


def block_extra_keys(spans: Sequence[MediaSpan], block_size: int) -> dict[int, list[MediaKey]]:
    """Per block index, the ``(identifier, offset)`` pairs of the items overlapping it,
    as vLLM computes them (``offset`` relative to the block's first token)."""
    extra: dict[int, list[MediaKey]] = {}
    for span in sorted(spans, key=lambda s: s.offset):
        if span.length <= 0:
            continue
        first = span.offset // block_size
        last = (span.offset + span.length - 1) // block_size
        for block in range(first, last + 1):
            extra.setdefault(block, []).append((span.identifier, span.offset - block * block_size))
    return extra
