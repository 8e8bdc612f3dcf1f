"""The vLLM KV-event codec against the golden payloads of every wire shape."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from router.events.types import AllBlocksCleared, BlockRemoved, BlockStored
from router.events.vllm import (
    END_SEQ,
    EventDecodeError,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)

GOLDEN = Path(__file__).parent.parent / "fixtures" / "vllm-kv-events"
EXPECTED: dict[str, dict] = json.loads((GOLDEN / "expected.json").read_text())
FILES = sorted(EXPECTED)


def _as_expected(event) -> dict:
    """Render a decoded event in expected.json's form (defaults omitted)."""
    out: dict = {"type": type(event).__name__}
    for field in event.__struct_fields__:
        value = getattr(event, field)
        if (value is not None and value is not False) or field == "parent_block_hash":
            out[field] = value
    return out


def _expected_event(raw: dict) -> dict:
    ev = {k: v for k, v in raw.items() if k != "ignored_by_index"}
    if "block_hashes_hex" in ev:
        ev.pop("block_hashes_hex")
        ev["block_hashes"] = ev.pop("low64")
    return ev


def test_every_golden_file_is_covered() -> None:
    on_disk = {p.name for p in GOLDEN.glob("*.msgpack")}
    assert on_disk == set(EXPECTED)


@pytest.mark.parametrize("name", FILES)
def test_decoder_reads_golden_payload(name: str) -> None:
    batch = decode_batch((GOLDEN / name).read_bytes())
    want = EXPECTED[name]
    assert batch.data_parallel_rank == want["data_parallel_rank"]
    assert [_as_expected(e) for e in batch.events] == [_expected_event(e) for e in want["events"]]


@pytest.mark.parametrize("name", FILES)
def test_index_ignores_exactly_the_marked_groups(name: str) -> None:
    batch = decode_batch((GOLDEN / name).read_bytes())
    for event, raw in zip(batch.events, EXPECTED[name]["events"], strict=True):
        if isinstance(event, BlockStored):
            assert event.indexed is not raw.get("ignored_by_index", False)


@pytest.mark.parametrize(
    "name", [n for n in FILES if n.split("-")[0] in ("v1", "v2", "v3") and "bytes" not in n]
)
def test_encoder_matches_golden_bytes(name: str) -> None:
    raw = (GOLDEN / name).read_bytes()
    batch = decode_batch(raw)
    shape = "-".join(name.split("-")[:2])
    encoded = encode_batch(batch.events, batch.ts, batch.data_parallel_rank, shape)  # type: ignore[arg-type]
    assert encoded == raw


def test_removed_and_cleared_round_trip_in_every_shape() -> None:
    events = [BlockRemoved([1, 2], "GPU"), AllBlocksCleared()]
    for shape in ("v1-array", "v2-mixed", "v3-map"):
        batch = decode_batch(encode_batch(events, 1.5, 3, shape))  # type: ignore[arg-type]
        assert batch.events == events and batch.data_parallel_rank == 3


def test_sequence_frames() -> None:
    assert encode_seq(0) == b"\x00" * 8
    assert decode_seq(encode_seq(2**40 + 7)) == 2**40 + 7
    assert decode_seq(END_SEQ) == 2**64 - 1
    with pytest.raises(EventDecodeError):
        decode_seq(b"\x01\x02")


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        b"\x93\xa1x\x90\xc0",  # ts is a string
        b"\x92\xcb\x41\xd9\x54\xfc\x40\x00\x00\x00\x91\x91\x01",  # a tag that is no name
        b"\x92\xcb\x41\xd9\x54\xfc\x40\x00\x00\x00\x91\x92\xabBlockStored\x01",  # missing fields
    ],
)
def test_garbage_is_a_named_error(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


def test_unknown_event_types_and_fields_are_counted_never_fatal() -> None:
    """Newer engines add events and fields (vLLM 0.32: locality, ownership, session_id):
    the rest of the batch still applies."""
    stored = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": list(range(16)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "locality": "LOCAL",
        "session_id": "s1",
        "a_field_from_the_future": 1,
    }
    positional = ["BlockRemoved", [1], "GPU", 0, "LOCAL", None, "future"]
    payload = msgspec.msgpack.encode(
        [1.5, [{"type": "BlockPinned", "block_hashes": [1]}, stored, positional], 0]
    )
    batch = decode_batch(payload)
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved"]
    assert batch.unknown_events == 1
    assert batch.unknown_fields == 2  # a_field_from_the_future, and "future"
