"""The KV-event decoder on hostile frames: only EventDecodeError, never anything else.

Every golden payload is also mutated (bytes flipped, cut, extended) and re-encoded
with hostile values in its fields; the subscriber relies on this to drop a bad frame
and keep its stream.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
from hypothesis import example, given
from hypothesis import strategies as st

from router.events.ingest import EventIngestor, StreamState
from router.events.types import BlockStored, EventBatch
from router.events.vllm import EventDecodeError, decode_batch, decode_seq
from router.index import MemoryIndex
from router.types import EngineKey

GOLDEN = sorted((Path(__file__).parent.parent / "fixtures" / "vllm-kv-events").glob("*.msgpack"))
PAYLOADS = [p.read_bytes() for p in GOLDEN]

# msgpack-able values, nested and of every kind the wire can carry
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=40)
)


def _nest(inner: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    # Dicts from key-value lists: no unique-key rejection sampling.
    pairs = st.lists(st.tuples(st.text(max_size=8), inner), max_size=6)
    return scalars | st.lists(inner, max_size=6) | pairs.map(dict)


# Three levels deep, spelt out: st.recursive's leaf budget is state kept between draws,
# which hypothesis's fuzz profile caught replaying differently (FlakyStrategyDefinition).
values = _nest(_nest(_nest(scalars)))
tags = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other", ""])


def decodes_or_rejects(payload: bytes) -> None:
    try:
        batch = decode_batch(payload)
    except EventDecodeError:
        return
    for event in batch.events:  # what was accepted is well-typed
        if isinstance(event, BlockStored):
            assert all(isinstance(h, int) for h in event.block_hashes)
            assert all(isinstance(t, int) and 0 <= t < 2**32 for t in event.token_ids)
            if event.token_ids:
                assert event.block_size > 0
            else:  # a tokenless store (offload placeholder) names its blocks by hash alone
                assert event.block_size >= 0
    asyncio.run(_ingest(batch))  # and ingesting it raises nothing


async def _ingest(batch: EventBatch) -> None:
    """Apply an accepted batch to a real index, as the subscriber would."""
    await EventIngestor(MemoryIndex()).apply(StreamState(EngineKey("127.0.0.1:9"), "m"), batch)


@given(st.binary(max_size=512))
def test_random_bytes(payload: bytes) -> None:
    decodes_or_rejects(payload)


@given(st.sampled_from(PAYLOADS), st.data())
def test_mutated_golden_payloads(payload: bytes, data: st.DataObject) -> None:
    raw = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    decodes_or_rejects(bytes(raw[:cut]) + data.draw(st.binary(max_size=16)))


@given(
    st.one_of(st.integers(-(2**63), 2**64 - 1), st.floats(), st.none(), st.text(max_size=5)),
    st.lists(
        st.one_of(
            st.tuples(tags, st.lists(values, max_size=12)).map(lambda t: [t[0], *t[1]]),
            st.dictionaries(st.sampled_from(["type", "block_hashes", "token_ids"]), values),
            values,
        ),
        max_size=5,
    ),
    st.one_of(st.none(), values),
)
@example(0, [["BlockStored", []]], None)  # tokenless and empty: accepted, ingest skips it
def test_well_formed_msgpack_with_hostile_fields(ts: object, events: list, rank: object) -> None:
    decodes_or_rejects(msgspec.msgpack.encode([ts, events, rank]))
    decodes_or_rejects(msgspec.msgpack.encode({"ts": ts, "events": events}))


def test_deep_nesting_is_rejected_not_a_recursion_error() -> None:
    deep: object = 0
    for _ in range(900):  # as deep as msgspec will encode
        deep = [deep]
    for payload in (
        msgspec.msgpack.encode([0.0, [["BlockStored", deep]]]),
        b"\x91" * 100_000,  # fixarray(1) nested 100,000 deep
    ):
        decodes_or_rejects(payload)


@given(st.binary(max_size=16))
def test_sequence_frames(frame: bytes) -> None:
    try:
        assert decode_seq(frame) >= -(2**63)
    except EventDecodeError:
        assert len(frame) != 8
