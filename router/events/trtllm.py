"""TensorRT-LLM's KV-cache events, decoded into the router's domain events.

TensorRT-LLM documents its events as what ``LLM.get_kv_cache_events()`` returns (and
``trtllm-serve`` relays): a list of maps made by ``KVCacheEventSerializer``, one per event::

    {"event_id": int, "window_size": int, "attention_dp_rank": int (optional),
     "data": {...}}

with ``data`` one of

* ``{"type": "created", "num_blocks_per_cache_level": [...]}``: the cache came up;
* ``{"type": "stored", "parent_hash": int | None, "blocks": [{"type": "stored_block",
  "block_hash": int, "tokens": [{"type": "unique_token", "token_id", "token_extra_id"}],
  "cache_level": int, "priority": int}]}``: blocks became reusable, chained from the
  parent's hash;
* ``{"type": "removed", "block_hashes": [...]}``: blocks left the cache (every level);
* ``{"type": "updated", "block_hash": int, "cache_level": {"type": "event_diff",
  "new_value", "old_value"}, "priority": {...}}``: a block moved between the primary
  (``0``, GPU) and secondary (``1``, host memory) pools, or changed priority.

There is no TensorRT-LLM ZMQ publisher of its own yet (a vLLM-compatible one is in
progress upstream): a relay of ``get_kv_cache_events()`` onto the router's ZMQ stream
sends ``[topic, seq, payload]`` with that list as the payload, msgpack- or JSON-encoded;
the emulator's ``--kv-events-format trtllm`` does so. ``decode_batch`` recognises such a
payload (a list of maps with ``event_id`` and ``data``) and hands it here.

Exact: stored blocks (hash, parent chain, token ids, primary vs secondary level),
removals, level moves (as a tokenless store on the new tier and a removal from the old,
resolved by engine hash), the data-parallel rank. Approximate: ``window_size`` is not
read (a variable-sliding-window model's window groups are indexed as if full attention);
blocks with non-zero ``token_extra_id`` (prompt-tuning / multimodal ids) are keyed by
their token ids alone; ``lora_id`` is not serialised upstream, so LoRA blocks are keyed as
the base model's; ``priority`` is not used; ``created`` is informational and dropped.
A stored event's blocks are split into runs of one token count and level, so a partial
last block arrives with its own block size and is dropped by the ingestor (counted as
``block_size_mismatch``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import msgspec

from router.events.types import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)
from router.types import Tier

_MASK64 = (1 << 64) - 1
#: TensorRT-LLM's cache levels: 0 the primary (GPU) pool, 1 the secondary (host) pool.
_LEVEL_MEDIUM = {0: MEDIUM_GPU, 1: MEDIUM_CPU}
_MEDIUM_LEVEL = {Tier.GPU: 0, Tier.CPU: 1, Tier.DISK: 1}


class TrtllmDecodeError(ValueError):
    """A TensorRT-LLM event list that does not have the documented shape."""


def looks_like_trtllm(obj: Any) -> bool:
    """Whether a decoded payload is a TensorRT-LLM event list."""
    return (
        isinstance(obj, list)
        and bool(obj)
        and all(isinstance(e, dict) and "data" in e and "event_id" in e for e in obj)
    )


def _hash(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TrtllmDecodeError(f"{name} must be an int")
    return value & _MASK64


def _level_medium(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TrtllmDecodeError("cache_level must be a non-negative int")
    return _LEVEL_MEDIUM.get(value, "DISK")


def _tokens(block: dict[str, Any]) -> list[int]:
    raw = block.get("tokens")
    if not isinstance(raw, list):
        raise TrtllmDecodeError("stored_block.tokens must be a list")
    out = []
    for token in raw:
        tid = token.get("token_id") if isinstance(token, dict) else token
        if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < 1 << 32:
            raise TrtllmDecodeError("token_id must be a uint32 int")
        out.append(tid)
    return out


def _stored(data: dict[str, Any]) -> list[KVEvent]:
    blocks = data.get("blocks")
    if not isinstance(blocks, list) or not blocks:
        raise TrtllmDecodeError("stored.blocks must be a non-empty list")
    parent = data.get("parent_hash")
    parent_hash = None if parent is None else _hash(parent, "parent_hash")
    out: list[KVEvent] = []
    run: list[tuple[int, list[int]]] = []
    run_key: tuple[int, str] | None = None

    def flush() -> None:
        nonlocal parent_hash
        if not run or run_key is None:
            return
        size, medium = run_key
        out.append(
            BlockStored(
                block_hashes=[h for h, _ in run],
                parent_block_hash=parent_hash,
                token_ids=[t for _, tokens in run for t in tokens],
                block_size=size,
                medium=medium,
            )
        )
        parent_hash = run[-1][0]
        run.clear()

    for block in blocks:
        if not isinstance(block, dict):
            raise TrtllmDecodeError("stored block must be a map")
        h = _hash(block.get("block_hash"), "block_hash")
        tokens = _tokens(block)
        key = (len(tokens), _level_medium(block.get("cache_level", 0)))
        if key != run_key:
            flush()
            run_key = key
        run.append((h, tokens))
    flush()
    return out


def _updated(data: dict[str, Any]) -> list[KVEvent]:
    h = _hash(data.get("block_hash"), "block_hash")
    diff = data.get("cache_level")
    if not isinstance(diff, dict):
        return []  # a priority change only
    new, old = diff.get("new_value"), diff.get("old_value")
    if new is None or new == old:
        return []
    events: list[KVEvent] = [BlockStored([h], None, [], 0, medium=_level_medium(new))]
    if old is not None:
        events.append(BlockRemoved([h], _level_medium(old)))
    return events


def decode_trtllm(obj: list[Any]) -> EventBatch:
    """Domain events of one decoded TensorRT-LLM event list."""
    events: list[KVEvent] = []
    unknown = 0
    rank: int | None = None
    ts = 0.0
    for entry in obj:
        data = entry.get("data")
        if not isinstance(data, dict):
            raise TrtllmDecodeError("event data must be a map")
        r = entry.get("attention_dp_rank")
        if isinstance(r, int) and not isinstance(r, bool):
            rank = r
        kind = data.get("type")
        if kind == "stored":
            events.extend(_stored(data))
        elif kind == "removed":
            hashes = data.get("block_hashes")
            if not isinstance(hashes, list):
                raise TrtllmDecodeError("removed.block_hashes must be a list")
            events.append(
                BlockRemoved([_hash(h, "block_hash") for h in hashes], None, all_tiers=True)
            )
        elif kind == "updated":
            events.extend(_updated(data))
        elif kind == "created":
            continue
        else:
            unknown += 1
    return EventBatch(ts=ts, events=events, data_parallel_rank=rank, unknown_events=unknown)


def parse_json(payload: bytes) -> Any:
    """A JSON-encoded event list (what ``trtllm-serve`` answers), or None if not JSON."""
    try:
        return json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return None


# --------------------------------------------------------------------------- encoding

_encoder = msgspec.msgpack.Encoder()


def as_trtllm_events(
    events: Sequence[KVEvent], first_event_id: int, window_size: int, rank: int | None
) -> list[dict[str, Any]]:
    """The model's events as ``get_kv_cache_events()`` lists them: a demotion (a
    tokenless store on CPU, then the GPU removal of the same blocks) is one ``updated``
    per block (level 0 -> 1); any other removal is ``removed``; a reset is the removal of
    what the engine held, which TensorRT-LLM has no event for: it is sent as nothing."""
    out: list[dict[str, Any]] = []
    demoted: set[int] = set()
    for event in events:
        data: dict[str, Any] | None = None
        if isinstance(event, BlockStored) and event.tokenless:
            level = _MEDIUM_LEVEL[Tier.from_medium(event.medium, event.locality)]
            for h in event.block_hashes:
                demoted.add(h)
                out.append(
                    {
                        "type": "updated",
                        "block_hash": h,
                        "cache_level": {"type": "event_diff", "new_value": level, "old_value": 0},
                        "priority": {"type": "event_diff", "new_value": 35, "old_value": 35},
                    }
                )
            continue
        if isinstance(event, BlockStored):
            bs = event.block_size
            level = _MEDIUM_LEVEL[Tier.from_medium(event.medium, event.locality)]
            data = {
                "type": "stored",
                "parent_hash": event.parent_block_hash,
                "blocks": [
                    {
                        "type": "stored_block",
                        "block_hash": h,
                        "tokens": [
                            {"type": "unique_token", "token_id": t, "token_extra_id": 0}
                            for t in event.token_ids[i * bs : (i + 1) * bs]
                        ],
                        "cache_level": level,
                        "priority": 35,
                    }
                    for i, h in enumerate(event.block_hashes)
                ],
            }
        elif isinstance(event, BlockRemoved):
            tier = Tier.from_medium(event.medium, event.locality)
            hashes = [h for h in event.block_hashes if not (tier is Tier.GPU and h in demoted)]
            if hashes:
                data = {"type": "removed", "block_hashes": hashes}
        elif isinstance(event, AllBlocksCleared):
            continue
        if data is not None:
            out.append(data)
    return [
        {
            "event_id": first_event_id + i,
            "data": data,
            "window_size": window_size,
            **({"attention_dp_rank": rank} if rank is not None else {}),
        }
        for i, data in enumerate(out)
    ]


def encode_trtllm_batch(events: Sequence[dict[str, Any]]) -> bytes:
    """A TensorRT-LLM event list as one msgpack payload frame."""
    return _encoder.encode(list(events))
