"""Small emulator parts with no network: rank endpoints, fault settings, wire frames."""

from __future__ import annotations

import asyncio

import pytest

from router.emulator.faults import Faults
from router.emulator.handoff import wire
from router.emulator.kv_publisher import rank_endpoint


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 2, "tcp://*:5559"),
        ("tcp://10.0.0.1:5557", 1, "tcp://10.0.0.1:5558"),
        ("tcp://127.0.0.1:*", 3, "tcp://127.0.0.1:*"),
        ("ipc:///tmp/events", 1, "ipc:///tmp/events_dp1"),
        ("inproc://events", 2, "inproc://events_dp2"),
    ],
)
def test_rank_endpoints_follow_vllm_offsets(endpoint: str, rank: int, expected: str) -> None:
    assert rank_endpoint(endpoint, rank) == expected


def test_fault_updates_are_validated_all_or_nothing() -> None:
    faults = Faults()
    faults.update({"fail_rate": 0.5, "stall_after_tokens": 3})
    assert (faults.fail_rate, faults.stall_after_tokens) == (0.5, 3)
    for bad, phrase in (
        ({"fail_rate": 2}, "fail_rate must be in"),
        ({"stall_after_tokens": -1}, "non-negative integer or null"),
        ({"kv_events_skip": None}, "non-negative integer"),
        ({"fail_health": "yes"}, "boolean"),
        ({"fail_rate": 0.1, "nope": 1}, "unknown fault 'nope'"),
    ):
        with pytest.raises(ValueError, match=phrase):
            faults.update(bad)
    assert (faults.fail_rate, faults.stall_after_tokens) == (0.5, 3)
    faults.clear()
    assert faults == Faults()


def test_kv_event_faults_are_spent_one_batch_at_a_time() -> None:
    faults = Faults(kv_events_skip=2)
    assert [faults.take_kv_skip() for _ in range(3)] == [True, True, False]
    assert faults.kv_events_skip == 0 and not faults.take_kv_garbage()


def test_a_prompt_digest_covers_tokens_adapter_and_salt() -> None:
    base = wire.prompt_digest([1, 2, 3], None, None)
    assert base == wire.prompt_digest([1, 2, 3], None, None)
    assert base != wire.prompt_digest([1, 2, 4], None, None)
    assert base != wire.prompt_digest([1, 2, 3], "sql", None)
    assert base != wire.prompt_digest([1, 2, 3], None, "tenant")


async def test_frames_round_trip_and_foreign_bytes_are_refused() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(len(b"\x81\xa2ok\xc3").to_bytes(4, "big") + b"\x81\xa2ok\xc3")
    assert await wire.read_frame(reader) == {"ok": True}
    reader.feed_data(b"HTTP/1.1 400 Bad Request\r\n")
    with pytest.raises(wire.WireError, match="does not speak this protocol"):
        await wire.read_frame(reader)
    reader = asyncio.StreamReader()
    reader.feed_eof()
    assert await wire.read_frame(reader) is None
