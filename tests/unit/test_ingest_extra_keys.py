"""KV events whose blocks carry vLLM 0.32's ``extra_keys``: media pairs, LoRA, salt.

vLLM publishes each block's extra keys untagged (``to_event_extra_keys``): the LoRA
name when ``lora_name`` is set, ``(mm_identifier, offset)`` pairs, the cache salt on a
prompt's first block, prompt-embedding digests. The events here go through the wire
encoder and decoder, so tuples arrive as msgpack arrays, as from a real engine.
"""

from __future__ import annotations

from typing import Any

import pytest

from router.events.ingest import EventIngestor, StreamState, block_extras_of, cache_salt_of
from router.events.types import BlockStored
from router.events.vllm import WIRE_FORMATS, decode_batch, encode_batch
from router.hashing import block_keys, seed_for
from router.index import MemoryIndex
from router.media import MediaSpan, block_extra_keys
from router.types import EngineKey

E = EngineKey("127.0.0.1:8000")
BS = 16
TOKENS = list(range(7000, 7000 + 4 * BS))
#: An image whose 20 placeholder tokens start at token 21: blocks 1 and 2.
IMAGE = MediaSpan("mm-hash-cat", 21, 20)


async def ingest(event: BlockStored, wire_format: str = "v2-mixed") -> MemoryIndex:
    index = MemoryIndex()
    batch = decode_batch(encode_batch([event], 0.0, wire_format=wire_format))  # type: ignore[arg-type]
    await EventIngestor(index).apply(StreamState(E, "llama", BS), batch)
    return index


def depth(
    index: MemoryIndex,
    media: list[MediaSpan],
    namespace: str = "llama",
    salt: str | None = None,
) -> int:
    keys = block_keys(TOKENS, BS, seed_for(namespace, salt), extra=block_extra_keys(media, BS))
    match = index.lookup_now(keys, [E]).get(E)
    return match.blocks if match else 0


def stored(extra_keys: list[Any] | None, lora_name: str | None = None) -> BlockStored:
    return BlockStored(
        [1, 2, 3, 4],
        None,
        TOKENS,
        BS,
        lora_id=1 if lora_name else None,
        medium="GPU",
        lora_name=lora_name,
        extra_keys=extra_keys,
    )


@pytest.mark.parametrize("wire_format", WIRE_FORMATS)
async def test_media_pairs_give_the_keys_the_request_side_computes(wire_format: str) -> None:
    event = stored([None, (("mm-hash-cat", 5),), (("mm-hash-cat", -11),), None])
    index = await ingest(event, wire_format)
    assert depth(index, [IMAGE]) == 4
    # Same text, another image: only the block before the image matches.
    assert depth(index, [MediaSpan("mm-hash-dog", 21, 20)]) == 1
    # The same tokens as text only: the image blocks never match them.
    assert depth(index, []) == 1


async def test_lora_media_and_salt_in_vllms_order() -> None:
    event = stored(
        [
            ("sql-adapter", ("mm-hash-cat", 5), "tenant-7"),
            ("sql-adapter", ("mm-hash-cat", -11)),
            ("sql-adapter", ("mm-hash-cat", -27)),
            ("sql-adapter",),
        ],
        lora_name="sql-adapter",
    )
    assert cache_salt_of(event) == "tenant-7"
    assert block_extras_of(event) == {
        0: [("mm-hash-cat", 5)],
        1: [("mm-hash-cat", -11)],
        2: [("mm-hash-cat", -27)],
    }
    index = await ingest(event)
    image = MediaSpan("mm-hash-cat", 5, 40)
    assert depth(index, [image], namespace="sql-adapter", salt="tenant-7") == 4
    assert depth(index, [image], namespace="sql-adapter") == 0
    assert depth(index, [image], salt="tenant-7") == 0


async def test_lora_and_salt_alone_keep_todays_keys() -> None:
    event = stored(
        [("sql-adapter", "tenant-7"), ("sql-adapter",), ("sql-adapter",), ("sql-adapter",)],
        lora_name="sql-adapter",
    )
    assert block_extras_of(event) == {}
    index = await ingest(event)
    assert depth(index, [], namespace="sql-adapter", salt="tenant-7") == 4


async def test_a_plain_models_null_extra_keys_change_nothing() -> None:
    index = await ingest(stored([None, None, None, None]))
    assert depth(index, []) == 4


def test_a_salt_spelled_like_the_adapter_is_still_a_salt() -> None:
    event = stored([("a", "a"), ("a",), ("a",), ("a",)], lora_name="a")
    assert cache_salt_of(event) == "a"
    assert cache_salt_of(stored([("a",), ("a",), ("a",), ("a",)], lora_name="a")) is None


async def test_prompt_embedding_blocks_never_match_token_prompts() -> None:
    index = await ingest(stored([None, (b"\x9f" * 32,), None, None]))
    assert depth(index, []) == 1
