"""Applying KV events to the index: keys recomputed from token ids, gaps, tiers, groups."""

from __future__ import annotations

import pytest

from router.events.ingest import EventIngestor, StreamState, cache_salt_of
from router.events.types import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from router.hashing import block_keys, seed_for
from router.index import Match, MemoryIndex
from router.types import EngineKey

E = EngineKey("127.0.0.1:8000")
BS = 16
TOKENS = list(range(5000, 5000 + 4 * BS))


@pytest.fixture
def index() -> MemoryIndex:
    return MemoryIndex()


@pytest.fixture
def ingestor(index: MemoryIndex) -> EventIngestor:
    return EventIngestor(index)


@pytest.fixture
def state() -> StreamState:
    return StreamState(E, "llama", BS)


def batch(*events) -> EventBatch:
    return EventBatch(0.0, list(events))


def request_depth(
    index: MemoryIndex, tokens: list[int], namespace: str = "llama", salt: str | None = None
) -> int:
    match = index.lookup_now(block_keys(tokens, BS, seed_for(namespace, salt)), [E]).get(E)
    return match.blocks if match else 0


async def test_root_and_child_events_yield_the_keys_requests_compute(
    index, ingestor, state
) -> None:
    await ingestor.apply(state, batch(BlockStored([0xA1, 0xA2], None, TOKENS[: 2 * BS], BS)))
    await ingestor.apply(state, batch(BlockStored([0xA3, 0xA4], 0xA2, TOKENS[2 * BS :], BS)))
    assert request_depth(index, TOKENS) == 4
    assert ingestor.counters.blocks_stored == 4


async def test_lora_blocks_are_keyed_by_the_adapter(index, ingestor, state) -> None:
    ev = BlockStored([1], None, TOKENS[:BS], BS, lora_id=3, lora_name="sql-adapter")
    await ingestor.apply(state, batch(ev))
    assert request_depth(index, TOKENS[:BS], namespace="sql-adapter") == 1
    assert request_depth(index, TOKENS[:BS]) == 0


async def test_cache_salt_in_the_first_blocks_extra_keys_seeds_the_chain(
    index, ingestor, state
) -> None:
    ev = BlockStored([1, 2], None, TOKENS[: 2 * BS], BS, extra_keys=[("tenant-7",), None])
    assert cache_salt_of(ev) == "tenant-7"
    await ingestor.apply(state, batch(ev))
    await ingestor.apply(state, batch(BlockStored([3], 2, TOKENS[2 * BS : 3 * BS], BS)))
    assert request_depth(index, TOKENS[: 3 * BS], salt="tenant-7") == 3
    assert request_depth(index, TOKENS[: 3 * BS]) == 0


def test_the_lora_name_is_not_mistaken_for_a_salt() -> None:
    ev = BlockStored([1], None, TOKENS[:BS], BS, lora_name="a", extra_keys=[("a",)])
    assert cache_salt_of(ev) is None


async def test_an_unknown_parent_is_skipped_and_counted(index, ingestor, state) -> None:
    await ingestor.apply(state, batch(BlockStored([9], 0xDEAD, TOKENS[:BS], BS)))
    assert ingestor.counters.skipped["unknown_parent"] == 1
    assert (await index.stats()).entries == 0


async def test_removal_maps_engine_hashes_back_to_keys(index, ingestor, state) -> None:
    await ingestor.apply(state, batch(BlockStored([1, 2, 3, 4], None, TOKENS, BS)))
    await ingestor.apply(state, batch(BlockRemoved([3, 77])))
    assert request_depth(index, TOKENS) == 2
    assert ingestor.counters.skipped["unknown_hash"] == 1


async def test_offloaded_copies_are_their_own_tier(index, ingestor, state) -> None:
    await ingestor.apply(
        state, batch(BlockStored([1, 2], None, TOKENS[: 2 * BS], BS, medium="GPU"))
    )
    await ingestor.apply(
        state, batch(BlockStored([1, 2], None, TOKENS[: 2 * BS], BS, medium="CPU"))
    )
    await ingestor.apply(state, batch(BlockRemoved([1, 2], "GPU")))
    keys = block_keys(TOKENS[: 2 * BS], BS, seed_for("llama"))
    assert index.lookup_now(keys, [E]) == {E: Match(2, offloaded=2)}


async def test_all_blocks_cleared_forgets_the_engine(index, ingestor, state) -> None:
    await ingestor.apply(state, batch(BlockStored([1, 2], None, TOKENS[: 2 * BS], BS)))
    await ingestor.apply(state, batch(AllBlocksCleared()))
    assert request_depth(index, TOKENS) == 0
    assert state.key_of(1) is None


async def test_sliding_window_groups_are_not_indexed(index, ingestor, state) -> None:
    swa = BlockStored(
        [5],
        None,
        TOKENS[:BS],
        BS,
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=4096,
    )
    await ingestor.apply(state, batch(swa, BlockRemoved([5], "GPU", group_idx=1)))
    assert request_depth(index, TOKENS) == 0
    assert ingestor.counters.skipped["ignored_group"] == 2
    assert ingestor.counters.skipped["unknown_hash"] == 0


async def test_a_block_size_mismatch_is_refused_and_reported(index, state) -> None:
    seen = []
    ingestor = EventIngestor(
        index, on_block_size_mismatch=lambda e, want, got: seen.append((e, want, got))
    )
    await ingestor.apply(state, batch(BlockStored([1], None, TOKENS[:32], 32)))
    assert seen == [(E, BS, 32)]
    assert (await index.stats()).entries == 0


async def test_token_count_must_match_the_blocks(index, ingestor, state) -> None:
    await ingestor.apply(state, batch(BlockStored([1, 2], None, TOKENS[:20], BS)))
    assert ingestor.counters.skipped["malformed"] == 1
