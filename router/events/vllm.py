"""vLLM's KV-event wire format: decode every shape seen in the wild, encode the current ones.

A ZMQ message is ``[topic, seq (8-byte big-endian), payload]``; the payload is a msgpack
``EventBatch``. Four payload shapes exist (see tests/fixtures/vllm-kv-events/README.md):

* ``v0-array``: ``[ts, events]`` or ``[ts, events, dp_rank]`` with positional events of
  older schemas (6-, 7-, 8-element ``BlockStored``; 2-, 3-element ``BlockRemoved``);
* ``v1-array``: ``[ts, events, dp_rank]`` with 12-element positional ``BlockStored``;
* ``v2-mixed``: the same array batch holding map events tagged by ``"type"`` (what vLLM
  0.32 publishes);
* ``v3-map``: a map batch ``{"ts", "events", "data_parallel_rank"}`` of map events (other
  publishers).

Hashes arrive as ints (the low 64 bits of the engine's digest) or raw digest bytes, of
which the low 64 bits (the last 8 bytes, big-endian) are used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from router.events import trtllm
from router.events.types import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent

WireFormat = Literal["v1-array", "v2-mixed", "v3-map"]
WIRE_FORMATS: tuple[WireFormat, ...] = ("v1-array", "v2-mixed", "v3-map")
#: The shape vLLM 0.32 publishes: an array batch of map events.
VLLM_WIRE_FORMAT: WireFormat = "v2-mixed"

#: What the emulator can publish: vLLM's shapes, and SGLang's (``router.events.sglang``).
EventFormat = Literal["v1-array", "v2-mixed", "v3-map", "sglang", "trtllm"]
EVENT_FORMATS: tuple[EventFormat, ...] = (*WIRE_FORMATS, "sglang", "trtllm")

ReplayFrames = Literal["topic", "legacy"]
#: ``topic``: vLLM 0.32's replies ``[b"", topic, seq, payload]`` ending with
#: ``[b"", b"", END_SEQ, b""]``; ``legacy``: older releases' ``[b"", seq, payload]``
#: ending with ``[b"", END_SEQ, b""]``.
REPLAY_FRAMES: tuple[ReplayFrames, ...] = ("topic", "legacy")

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


#: Field order of vLLM's positional events (SGLang's ``BlockStored`` uses the same
#: order); ``locality`` and ``ownership`` arrived with vLLM 0.32 and choose the tier,
#: ``session_id`` is read but not used (nor are fields past these).
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
    "locality",
    "ownership",
    "session_id",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
#: SGLang's newest positional ``BlockRemoved`` carries the store's cache-spec slots
#: before locality and ownership (7 fields; vLLM's positional form never had 7).
_SGLANG_REMOVED_FIELDS = (
    "block_hashes",
    "medium",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
)
#: SGLang's prefix on a cache salt it puts in ``extra_keys`` (Dynamo's convention).
SGLANG_SALT_PREFIX = "dynamo-cache-salt:"
_KNOWN_FIELDS = {
    "BlockStored": frozenset(("type", *_STORED_FIELDS)),
    "BlockRemoved": frozenset(("type", *_SGLANG_REMOVED_FIELDS)),
    "AllBlocksCleared": frozenset(("type",)),
}


class _UnknownEvent(Exception):
    """An event of a type this decoder does not know (counted, never fatal)."""


def _metadata_salt(value: Any) -> str | None:
    """The cache salt of SGLang's typed ``BlockStored`` metadata map, if any."""
    salt = value.get("cache_salt") if isinstance(value, dict) else None
    return salt if isinstance(salt, str) else None


def _stored(f: dict[str, Any]) -> BlockStored:
    if "block_hashes" not in f:
        raise EventDecodeError("BlockStored lacks block_hashes")
    if "block_size" not in f and f.get("token_ids"):
        raise EventDecodeError("BlockStored has token_ids but no block_size")
    extra = f.get("extra_keys")
    lora_name = f.get("lora_name")
    # SGLang before its positional layout settled put a metadata map ({"cache_salt"})
    # right after ``medium``, in the ``lora_name`` slot: read the salt, not a name.
    salt = _metadata_salt(lora_name)
    if isinstance(lora_name, dict):
        lora_name = None
    if extra is not None and not isinstance(extra, list):
        raise EventDecodeError("extra_keys must be a list or nil")
    if extra is None and salt is not None:
        extra = [[salt]]
    # A tokenless store (token_ids empty or absent, block_size 0 or absent) names
    # blocks by engine hash alone: the GPU -> CPU offload placeholder.
    tokens = _tokens(f.get("token_ids") or [])
    block_size = _int(f.get("block_size", 0), "block_size")
    if block_size < 0 or (block_size == 0 and tokens):
        raise EventDecodeError("block_size must be positive")
    return BlockStored(
        block_hashes=_hashes(f["block_hashes"]),
        parent_block_hash=_opt_hash(f.get("parent_block_hash")),
        token_ids=tokens,
        block_size=block_size,
        lora_id=_opt_int(f.get("lora_id"), "lora_id"),
        medium=_opt_str(f.get("medium"), "medium"),
        lora_name=_opt_str(lora_name, "lora_name"),
        extra_keys=extra,
        group_idx=_opt_int(f.get("group_idx"), "group_idx"),
        kv_cache_spec_kind=_opt_str(f.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
        kv_cache_spec_sliding_window=_opt_int(
            f.get("kv_cache_spec_sliding_window"), "kv_cache_spec_sliding_window"
        ),
        locality=_opt_str(f.get("locality"), "locality"),
        ownership=_opt_str(f.get("ownership"), "ownership"),
    )


def _removed(f: dict[str, Any]) -> BlockRemoved:
    if "block_hashes" not in f:
        raise EventDecodeError("BlockRemoved lacks block_hashes")
    return BlockRemoved(
        block_hashes=_hashes(f["block_hashes"]),
        medium=_opt_str(f.get("medium"), "medium"),
        group_idx=_opt_int(f.get("group_idx"), "group_idx"),
        locality=_opt_str(f.get("locality"), "locality"),
        ownership=_opt_str(f.get("ownership"), "ownership"),
    )


def _event(raw: Any) -> tuple[KVEvent, int]:
    """One event and how many of its fields this decoder does not know."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise EventDecodeError("event map lacks a string 'type'")
        fields = raw
        known = _KNOWN_FIELDS.get(tag)
        if known is None:
            raise _UnknownEvent(tag)
        unknown = sum(1 for name in raw if name not in known)
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        if not isinstance(tag, str):
            raise EventDecodeError("positional event lacks its type name")
        if tag not in _KNOWN_FIELDS:
            raise _UnknownEvent(tag)
        if tag == "BlockStored":
            names: tuple[str, ...] = _STORED_FIELDS
        elif tag == "BlockRemoved":
            names = _SGLANG_REMOVED_FIELDS if len(raw) == 8 else _REMOVED_FIELDS
        else:
            names = ()
        fields = dict(zip(names, raw[1:], strict=False))
        unknown = max(len(raw) - 1 - len(names), 0)
    else:
        raise EventDecodeError("event must be a tagged array or a map with 'type'")
    return _known_event(tag, fields), unknown


def _known_event(tag: str, fields: dict[str, Any]) -> KVEvent:
    if tag == "BlockStored":
        return _stored(fields)
    if tag == "BlockRemoved":
        return _removed(fields)
    return AllBlocksCleared()


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one payload frame in any known shape into domain events: vLLM's,
    SGLang's (the same positional layout, see ``router.events.sglang``) or a relayed
    TensorRT-LLM event list (``router.events.trtllm``)."""
    try:
        obj = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        obj = trtllm.parse_json(payload) if payload[:1] == b"[" else None
        if obj is None:
            raise EventDecodeError(f"not msgpack: {exc}") from None
    except RecursionError:  # nesting past the interpreter's limit: hostile, not vLLM
        raise EventDecodeError("payload nests too deeply") from None
    if obj == []:  # a TensorRT-LLM relay's empty poll
        return EventBatch(ts=0.0, events=[])
    if trtllm.looks_like_trtllm(obj):
        try:
            return trtllm.decode_trtllm(obj)
        except (trtllm.TrtllmDecodeError, RecursionError) as exc:
            raise EventDecodeError(f"TensorRT-LLM events: {exc}") from None
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
    decoded: list[KVEvent] = []
    unknown_events = unknown_fields = 0
    for raw in events:
        try:
            event, unknown = _event(raw)
        except _UnknownEvent:
            unknown_events += 1
            continue
        decoded.append(event)
        unknown_fields += unknown
    return EventBatch(
        ts=float(ts),
        events=decoded,
        data_parallel_rank=_opt_int(rank, "data_parallel_rank"),
        unknown_events=unknown_events,
        unknown_fields=unknown_fields,
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
    wire_format: WireFormat = VLLM_WIRE_FORMAT,
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


def replay_reply(frames: list[bytes]) -> tuple[bytes, bytes] | None:
    """``(seq, payload)`` of one replay reply, or None if it is not one.

    vLLM 0.32 answers ``[b"", topic, seq, payload]`` and ends with
    ``[b"", b"", END_SEQ, b""]``; older releases answered ``[b"", seq, payload]`` and
    ``[b"", END_SEQ, b""]``.
    """
    if not frames or frames[0] != b"":
        return None
    if len(frames) == 4:
        return frames[2], frames[3]
    if len(frames) == 3:
        return frames[1], frames[2]
    return None
