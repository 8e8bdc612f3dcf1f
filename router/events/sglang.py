"""SGLang's KV-event wire format: what the emulator sends with ``--kv-events-format sglang``.

SGLang's ``ZmqEventPublisher`` (``python/sglang/srt/disaggregation/kv_events.py``) sends
the same multipart message as vLLM, ``[topic, seq (8-byte big-endian), payload]``, with a
msgpack payload of msgspec ``array_like`` structs that are *not* ``omit_defaults``:

* batch ``[ts, events, attn_dp_rank]`` (the rank is always filled in by the publisher);
* ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium]``: one event per radix-tree page (``block_size`` is the page's token count),
  chained to the previous page by ``parent_block_hash``; hashes are signed 64-bit ints
  (``hash_str_to_int64`` of a sha256); a cache salt rides in a trailing typed metadata
  map ``{"cache_salt": ...}`` (``BlockStoredWithMetadata``);
* ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``;
* ``medium`` is a ``StorageMedium``: ``GPU``, ``CPU_PINNED`` (HiCache host pool), ``DISK``,
  ``EXTERNAL`` (a shared pool such as Mooncake). A GPU -> host demotion is a
  ``BlockRemoved`` on ``GPU`` after the host ``BlockStored`` (write-through) that carries
  the page's tokens.

Replay answers ``[b"", seq, payload]`` and ends with ``[b"", END_SEQ, b""]``, where
``END_SEQ`` is ``(-1).to_bytes(8, "big", signed=True)``: vLLM's older ("legacy") frames.
Each data-parallel rank publishes on the base port + rank.

Newer SGLang releases widened ``BlockStored`` to vLLM's 13-field positional layout (with
the salt, prefixed ``dynamo-cache-salt:``, in ``extra_keys``) and ``BlockRemoved`` to
7 fields (``medium, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window,
locality, ownership``); ``router.events.vllm.decode_batch`` reads every one of these
shapes, so there is no separate SGLang decoder. This module only encodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from router.events.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from router.types import Tier

#: SGLang's ``StorageMedium`` value per tier.
SGLANG_MEDIUM = {Tier.GPU: "GPU", Tier.CPU: "CPU_PINNED", Tier.DISK: "DISK"}

_encoder = msgspec.msgpack.Encoder()


def _signed(h: int) -> int:
    """A 64-bit hash as SGLang's signed int64."""
    return h - (1 << 64) if h >= 1 << 63 else h


def _salt(event: BlockStored) -> str | None:
    from router.events.ingest import cache_salt_of  # avoids an import cycle

    return cache_salt_of(event) if event.parent_block_hash is None else None


def _wire_event(event: KVEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        medium = SGLANG_MEDIUM[Tier.from_medium(event.medium, event.locality)]
        wire: list[Any] = [
            "BlockStored",
            [_signed(h) for h in event.block_hashes],
            None if event.parent_block_hash is None else _signed(event.parent_block_hash),
            list(event.token_ids),
            event.block_size,
            None,  # SGLang publishes no LoRA id
            medium,
        ]
        salt = _salt(event)
        if salt is not None:
            wire.append({"cache_salt": salt})
        return wire
    if isinstance(event, BlockRemoved):
        medium = SGLANG_MEDIUM[Tier.from_medium(event.medium, event.locality)]
        return ["BlockRemoved", [_signed(h) for h in event.block_hashes], medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {event!r}")


def as_sglang_sends(events: Sequence[KVEvent]) -> list[KVEvent]:
    """The model's events split as SGLang publishes them: one ``BlockStored`` per page
    (chained by parent hash) and one ``BlockRemoved`` per page. Tokenless stores (the
    offload placeholder SGLang never sends) are dropped."""
    out: list[KVEvent] = []
    for event in events:
        if isinstance(event, BlockStored):
            if event.tokenless:
                continue
            bs = event.block_size
            parent = event.parent_block_hash
            extra = event.extra_keys
            for i, h in enumerate(event.block_hashes):
                out.append(
                    msgspec.structs.replace(
                        event,
                        block_hashes=[h],
                        parent_block_hash=parent,
                        token_ids=event.token_ids[i * bs : (i + 1) * bs],
                        extra_keys=[extra[i]] if extra is not None and i < len(extra) else None,
                    )
                )
                parent = h
        elif isinstance(event, BlockRemoved):
            out.extend(msgspec.structs.replace(event, block_hashes=[h]) for h in event.block_hashes)
        else:
            out.append(event)
    return out


def encode_sglang_batch(events: Sequence[KVEvent], ts: float, attn_dp_rank: int = 0) -> bytes:
    """Encode events as SGLang's publisher does (events already split per page)."""
    return _encoder.encode([ts, [_wire_event(e) for e in events], attn_dp_rank])
