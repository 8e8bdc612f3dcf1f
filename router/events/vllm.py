"""vLLM's KV-event wire format: decode every shape seen in the wild, encode the current ones.

A ZMQ message is ``[topic, seq (8-byte big-endian), payload]``; the payload is a msgpack
``EventBatch``. Four payload shapes exist (see tests/fixtures/vllm-kv-events/README.md):

* ``v0-array``: ``[ts, events]`` or ``[ts, events, dp_rank]`` with positional events of
  older schemas (6-, 7-, 8-element ``BlockStored``; 2-, 3-element ``BlockRemoved``);
* ``v1-array``: ``[ts, events, dp_rank]`` with 12-element positional ``BlockStored``;
* ``v2-mixed``: the same array batch holding map events tagged by ``"type"``;
* ``v3-map``: a map batch ``{"ts", "events", "data_parallel_rank"}`` of map events.

Hashes arrive as ints (the low 64 bits of the engine's digest) or raw digest bytes, of
which the low 64 bits (the last 8 bytes, big-endian) are used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from router.events.types import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent

WireFormat = Literal["v1-array", "v2-mixed", "v3-map"]
WIRE_FORMATS: tuple[WireFormat, ...] = ("v1-array", "v2-mixed", "v3-map")

SEQ_BYTES = 8
#: The replay socket's end-of-replay marker in the seq frame.
END_SEQ = b"\xff" * SEQ_BYTES
_MASK64 = (1 << 64) - 1


class EventDecodeError(ValueError):
    """A payload that is not a KV-event batch in any known shape."""


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise EventDecodeError(f"sequence frame has {len(frame)} bytes, expected {SEQ_BYTES}")
    return int.from_bytes(frame, "big")


# --------------------------------------------------------------------------- decoding

_decoder = msgspec.msgpack.Decoder()


def _hash(value: Any) -> int:
    if isinstance(value, bool):
        raise EventDecodeError("block hash must be an int or bytes, got bool")
    if isinstance(value, int):
        return value & _MASK64
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if not raw:
            raise EventDecodeError("empty block hash")
        return int.from_bytes(raw[-8:], "big")
    raise EventDecodeError(f"block hash must be an int or bytes, got {type(value).__name__}")


def _hashes(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise EventDecodeError("block_hashes must be a list")
    return [_hash(v) for v in value]


def _opt_hash(value: Any) -> int | None:
    return None if value is None else _hash(value)


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise EventDecodeError(f"{name} must be an int")
    return value


def _opt_int(value: Any, name: str) -> int | None:
    return None if value is None else _int(value, name)


def _opt_str(value: Any, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise EventDecodeError(f"{name} must be a string or nil")


def _tokens(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise EventDecodeError("token_ids must be a list")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or t >= 1 << 32:
            raise EventDecodeError("token_ids must hold uint32 ints")
    return value


_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _stored(f: dict[str, Any]) -> BlockStored:
    if "block_hashes" not in f or "token_ids" not in f or "block_size" not in f:
        raise EventDecodeError("BlockStored lacks block_hashes, token_ids or block_size")
    extra = f.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise EventDecodeError("extra_keys must be a list or nil")
    block_size = _int(f["block_size"], "block_size")
    if block_size <= 0:
        raise EventDecodeError("block_size must be positive")
    return BlockStored(
        block_hashes=_hashes(f["block_hashes"]),
        parent_block_hash=_opt_hash(f.get("parent_block_hash")),
        token_ids=_tokens(f["token_ids"]),
        block_size=block_size,
        lora_id=_opt_int(f.get("lora_id"), "lora_id"),
        medium=_opt_str(f.get("medium"), "medium"),
        lora_name=_opt_str(f.get("lora_name"), "lora_name"),
        extra_keys=extra,
        group_idx=_opt_int(f.get("group_idx"), "group_idx"),
        kv_cache_spec_kind=_opt_str(f.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
        kv_cache_spec_sliding_window=_opt_int(
            f.get("kv_cache_spec_sliding_window"), "kv_cache_spec_sliding_window"
        ),
    )


def _removed(f: dict[str, Any]) -> BlockRemoved:
    if "block_hashes" not in f:
        raise EventDecodeError("BlockRemoved lacks block_hashes")
    return BlockRemoved(
        block_hashes=_hashes(f["block_hashes"]),
        medium=_opt_str(f.get("medium"), "medium"),
        group_idx=_opt_int(f.get("group_idx"), "group_idx"),
    )


def _event(raw: Any) -> KVEvent:
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS
        if len(raw) - 1 > len(names):
            raise EventDecodeError(f"{tag} has {len(raw) - 1} fields, at most {len(names)} known")
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise EventDecodeError("event must be a tagged array or a map with 'type'")
    if tag == "BlockStored":
        return _stored(fields)
    if tag == "BlockRemoved":
        return _removed(fields)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise EventDecodeError(f"unknown event type {tag!r}")


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one payload frame in any known shape into domain events."""
    try:
        obj = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"not msgpack: {exc}") from None
    except RecursionError:  # nesting past the interpreter's limit: hostile, not vLLM
        raise EventDecodeError("payload nests too deeply") from None
    if isinstance(obj, dict):
        ts, events, rank = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
    elif isinstance(obj, list) and len(obj) in (2, 3):
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) == 3 else None
    else:
        raise EventDecodeError("batch must be [ts, events(, dp_rank)] or a map")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise EventDecodeError("batch ts must be a number")
    if not isinstance(events, list):
        raise EventDecodeError("batch events must be a list")
    return EventBatch(
        ts=float(ts),
        events=[_event(e) for e in events],
        data_parallel_rank=_opt_int(rank, "data_parallel_rank"),
    )


# --------------------------------------------------------------------------- encoding
# Wire structs mirror vLLM's msgspec classes so the bytes match a real engine's.


class _ArrayEvent(msgspec.Struct, array_like=True, tag=True, gc=False):
    pass


class _ArrayStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None
    group_idx: int | None
    kv_cache_spec_kind: str | None
    kv_cache_spec_sliding_window: int | None


class _ArrayRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None


class _ArrayCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class _MapEvent(msgspec.Struct, omit_defaults=True, tag_field="type", tag=True, gc=False):
    pass


class _MapStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _MapRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class _MapCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None


class _MapBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def _wire_event(event: KVEvent, as_map: bool) -> Any:
    if isinstance(event, BlockStored):
        cls: Any = _MapStored if as_map else _ArrayStored
        return cls(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
            event.extra_keys,
            event.group_idx,
            event.kv_cache_spec_kind,
            event.kv_cache_spec_sliding_window,
        )
    if isinstance(event, BlockRemoved):
        cls = _MapRemoved if as_map else _ArrayRemoved
        return cls(event.block_hashes, event.medium, event.group_idx)
    return _MapCleared() if as_map else _ArrayCleared()


def encode_batch(
    events: Sequence[KVEvent],
    ts: float,
    data_parallel_rank: int | None = None,
    wire_format: WireFormat = "v3-map",
) -> bytes:
    """Encode events as one payload frame, byte-compatible with vLLM's publisher."""
    as_map = wire_format != "v1-array"
    wire = [_wire_event(e, as_map) for e in events]
    batch: Any
    if wire_format == "v3-map":
        batch = _MapBatch(ts, wire, data_parallel_rank)
    elif wire_format in ("v1-array", "v2-mixed"):
        batch = _ArrayBatch(ts, wire, data_parallel_rank)
    else:
        raise ValueError(f"unknown KV-event wire format {wire_format!r}")
    return _encoder.encode(batch)
