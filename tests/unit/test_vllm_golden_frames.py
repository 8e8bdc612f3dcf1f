"""Frames captured from a real vLLM (tests/fixtures/vllm-0.32-frames, written by
``make vllm-frames``): every PUB message decodes to what plain msgpack says it holds, and
the replay exchange parses as the subscriber reads it, ending with the marker."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from router.events.types import AllBlocksCleared, BlockRemoved, BlockStored
from router.events.vllm import END_SEQ, decode_batch, decode_seq, replay_reply

FRAMES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32-frames"
MANIFEST = json.loads((FRAMES / "manifest.json").read_text())
MESSAGES: list[dict[str, Any]] = MANIFEST["messages"]
TYPES = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


def test_the_frames_come_from_vllm_0_32_in_both_hash_shapes() -> None:
    assert MANIFEST["vllm_version"].startswith("0.32")
    kinds = {e.get("hash_kind") for m in MESSAGES for e in m["events"]}
    assert {"int", "bytes"} <= kinds
    seen = {e["type"] for m in MESSAGES for e in m["events"]}
    assert seen == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    # What vLLM 0.32 publishes: an array batch [ts, events, rank] of map events.
    assert {m["batch_shape"] for m in MESSAGES} == {"array"}


@pytest.mark.parametrize("message", MESSAGES, ids=[m["file"] for m in MESSAGES])
def test_every_captured_message_decodes_to_its_events(message: dict[str, Any]) -> None:
    batch = decode_batch((FRAMES / message["file"]).read_bytes())
    assert batch.unknown_events == 0 and batch.unknown_fields == 0
    assert [type(e) for e in batch.events] == [TYPES[e["type"]] for e in message["events"]]
    for event, expected in zip(batch.events, message["events"], strict=True):
        if isinstance(event, (BlockStored, BlockRemoved)):
            assert len(event.block_hashes) == expected["hashes"]
            assert all(0 <= h < 1 << 64 for h in event.block_hashes)
        if isinstance(event, BlockStored):
            assert len(event.token_ids) == expected["tokens"] == 32 * expected["hashes"]
            assert event.block_size == MANIFEST["block_size"]
            assert (event.parent_block_hash is not None) == expected["has_parent"]
            assert event.indexed


@pytest.mark.parametrize("label", ["int", "bytes"])
def test_a_captured_replay_exchange_parses_to_the_published_batches(label: str) -> None:
    exchange = json.loads((FRAMES / f"{label}-replay.json").read_text())
    replies = [[base64.b64decode(f) for f in frames] for frames in exchange["replies"]]
    parsed = [replay_reply(frames) for frames in replies]
    assert all(p is not None for p in parsed)
    *batches, end = parsed
    assert end is not None and end[0] == END_SEQ
    assert all(len(frames) == 4 for frames in replies)  # vLLM 0.32: a topic frame
    published = {
        m["seq"]: (FRAMES / m["file"]).read_bytes() for m in MESSAGES if m["file"].startswith(label)
    }
    seqs = [decode_seq(seq) for seq, _ in batches]  # type: ignore[misc]
    assert seqs == sorted(seqs) and seqs[0] == 0
    for seq, payload in batches:  # type: ignore[misc]
        if decode_seq(seq) in published:
            assert payload == published[decode_seq(seq)]
