"""KV tiers and the engines beyond vLLM's GPU tier: vLLM 0.32's offload events (encoded
by vLLM's own classes), SGLang's events of three releases (vectors built from its
classes' shapes), the tier mapping, the tokenless store and the policies' weighting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from router.config import PolicyConfig
from router.events.ingest import EventIngestor, StreamState, cache_salt_of
from router.events.sglang import as_sglang_sends, encode_sglang_batch
from router.events.types import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from router.events.vllm import decode_batch
from router.hashing import block_keys, seed_for
from router.index import Match, MemoryIndex
from router.policy.base import RouteRequest
from router.policy.kv_cost import KVCostPolicy
from router.types import EngineKey, Tier

FIXTURES = Path(__file__).parents[1] / "fixtures"
VLLM_OFFLOAD = FIXTURES / "vllm-offload-events"
SGLANG = FIXTURES / "sglang-kv-events"
E = EngineKey("127.0.0.1:8000")
MASK64 = (1 << 64) - 1


def _read(directory: Path, name: str) -> EventBatch:
    return decode_batch((directory / f"{name}.msgpack").read_bytes())


# --------------------------------------------------------------------------- tier mapping


@pytest.mark.parametrize(
    ("medium", "locality", "tier"),
    [
        (None, None, Tier.GPU),
        ("GPU", None, Tier.GPU),
        ("gpu", "LOCAL", Tier.GPU),
        ("CPU", None, Tier.CPU),
        ("CPU", "LOCAL", Tier.CPU),
        ("CPU_PINNED", None, Tier.CPU),  # SGLang's HiCache host pool
        ("STORAGE", None, Tier.DISK),  # vLLM's disk / shared storage
        ("DISK", None, Tier.DISK),
        ("EXTERNAL", None, Tier.DISK),  # SGLang's shared pool (Mooncake)
        ("CPU", "REMOTE", Tier.DISK),  # another node's memory is the slowest tier
        ("GPU", "REMOTE", Tier.DISK),
    ],
)
def test_medium_and_locality_choose_the_tier(
    medium: str | None, locality: str | None, tier: Tier
) -> None:
    assert Tier.from_medium(medium, locality) is tier


def test_ownership_names_a_residency_not_a_speed() -> None:
    assert Tier.from_medium("CPU", "LOCAL", "kvcr") is Tier.CPU


# --------------------------------------------------------------------------- vLLM offload


def _tiers_match(tiers: dict[str, int]) -> Match:
    cpu, disk = tiers.get("CPU", 0), tiers.get("DISK", 0)
    return Match(tiers.get("GPU", 0) + cpu + disk, cpu + disk, disk)


async def test_vllm_offload_frames_move_blocks_between_tiers_and_keep_the_copies() -> None:
    expected = json.loads((VLLM_OFFLOAD / "expected.json").read_text())
    index = MemoryIndex()
    ingestor = EventIngestor(index)
    state = StreamState(E, "llama", expected["block_size"])
    keys = block_keys(expected["tokens"], expected["block_size"], seed_for("llama"))
    for name in expected["order"]:
        await ingestor.apply(state, _read(VLLM_OFFLOAD, name))
        want = expected[name]
        assert index.lookup_now(keys, [E]).get(E) == _tiers_match(want["tiers_after"]), name
    counters = ingestor.counters
    assert counters.tokenless_blocks == 4  # 3 CPU copies and 1 remote-storage copy
    assert counters.skipped["tokenless_unresolved"] == 1
    assert counters.skipped["malformed"] == 0
    assert counters.skipped["unknown_hash"] == 0


def test_the_placeholder_store_decodes_tokenless_with_its_tier_fields() -> None:
    batch = _read(VLLM_OFFLOAD, "remote-storage-placeholder")
    stored, removed = batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.tokenless and stored.block_size == 0 and stored.parent_block_hash is None
    assert (stored.medium, stored.locality, stored.ownership) == ("STORAGE", "REMOTE", "kvcr")
    assert (removed.medium, removed.locality) == ("CPU", "LOCAL")
    assert batch.unknown_fields == 0


async def test_a_tokenless_store_of_a_gpu_block_adds_the_cpu_tier() -> None:
    index = MemoryIndex()
    ingestor = EventIngestor(index)
    state = StreamState(E, "llama", 16)
    tokens = list(range(32))
    keys = block_keys(tokens, 16, seed_for("llama"))
    await ingestor.apply(state, EventBatch(0.0, [BlockStored([7, 8], None, tokens, 16)]))
    await ingestor.apply(state, EventBatch(0.0, [BlockStored([8], None, [], 0, medium="CPU")]))
    # Block 1 is on GPU and CPU: it counts at its best tier.
    assert index.lookup_now(keys, [E]) == {E: Match(2)}
    await ingestor.apply(state, EventBatch(0.0, [BlockRemoved([7, 8], "GPU")]))
    # Removal from GPU drops block 0 (held nowhere else) but keeps block 1's CPU copy;
    # the walk stops at block 0 now, so the copy shows from block 1's own prefix only.
    assert index.lookup_now(keys, [E]) == {}
    assert index.lookup_now(keys[1:], [E]) == {E: Match(1, offloaded=1)}
    assert state.key_of(8) == keys[1]


# --------------------------------------------------------------------------- SGLang


def _sglang_expected() -> dict[str, Any]:
    return json.loads((SGLANG / "expected.json").read_text())


@pytest.mark.parametrize("name", sorted(_sglang_expected()))
def test_sglang_vectors_decode_to_the_expected_domain_events(name: str) -> None:
    want = _sglang_expected()[name]
    batch = _read(SGLANG, name)
    assert batch.data_parallel_rank == want["rank"]
    assert batch.unknown_events == 0
    assert len(batch.events) == len(want["events"])
    for event, expected in zip(batch.events, want["events"], strict=True):
        assert type(event).__name__ == expected["type"]
        if isinstance(event, AllBlocksCleared):
            continue
        assert event.block_hashes == expected["block_hashes"]
        assert event.medium == expected["medium"]
        assert Tier.from_medium(event.medium, event.locality).name == expected["tier"]
        if isinstance(event, BlockStored):
            assert event.parent_block_hash == expected["parent_block_hash"]
            assert event.token_ids == expected["token_ids"]
            assert event.block_size == expected["block_size"]
            assert event.lora_name is None
            salt = cache_salt_of(event) if event.parent_block_hash is None else None
            assert salt == expected["cache_salt"]


async def test_sglang_pages_chain_into_the_request_keys_and_demote_to_the_host_tier() -> None:
    index = MemoryIndex()
    ingestor = EventIngestor(index)
    state = StreamState(EngineKey("127.0.0.1:30000", 1), "qwen", 16)
    tokens = list(range(1000, 1048))
    keys = block_keys(tokens, 16, seed_for("qwen"))
    await ingestor.apply(state, _read(SGLANG, "r2-stored-root-rank1"))
    assert index.lookup_now(keys, [state.engine]) == {state.engine: Match(3)}
    await ingestor.apply(state, _read(SGLANG, "r2-host-demotion"))
    # Page 0 left the GPU for the host pool; pages 1 and 2 are still on GPU.
    assert index.lookup_now(keys, [state.engine]) == {state.engine: Match(3, offloaded=1)}
    await ingestor.apply(state, _read(SGLANG, "r3-disk-store-and-removals"))
    assert index.lookup_now(keys, [state.engine]) == {}  # AllBlocksCleared ends it
    assert ingestor.counters.skipped["unknown_parent"] == 0


@pytest.mark.parametrize("name", ["r2-stored-salted-root", "r3-stored-salted-root"])
async def test_sglangs_salt_seeds_the_root_as_the_request_side_does(name: str) -> None:
    index = MemoryIndex()
    ingestor = EventIngestor(index)
    state = StreamState(E, "qwen", 16)
    await ingestor.apply(state, _read(SGLANG, name))
    tokens = list(range(1000, 1016))
    salted = block_keys(tokens, 16, seed_for("qwen", "tenant-a"))
    assert index.lookup_now(salted, [E]) == {E: Match(1)}
    assert index.lookup_now(block_keys(tokens, 16, seed_for("qwen")), [E]) == {}


def test_the_emulators_sglang_encoding_is_sglangs_bytes() -> None:
    hashes = [h & MASK64 for h in (-0x3A5F0C1D2E4B6978, 0x1B2C3D4E5F607182, -0x0102030405060708)]
    stored = BlockStored(hashes, None, list(range(1000, 1048)), 16, medium="GPU")
    ours = encode_sglang_batch(as_sglang_sends([stored]), 3.0, 1)
    assert ours == (SGLANG / "r2-stored-root-rank1.msgpack").read_bytes()
    demotion = [
        BlockStored(hashes[:1], None, list(range(1000, 1016)), 16, medium="CPU"),
        BlockRemoved(hashes[:1], "GPU"),
    ]
    ours = encode_sglang_batch(as_sglang_sends(demotion), 5.0, 0)
    assert ours == (SGLANG / "r2-host-demotion.msgpack").read_bytes()


# --------------------------------------------------------------------------- weighting


def _req(prompt_tokens: int = 2000) -> RouteRequest:
    return RouteRequest("r1", list(range(prompt_tokens // 16)), prompt_tokens, 16)


def test_match_weighs_each_tier() -> None:
    m = Match(10, offloaded=6, disk=2)
    assert m.weighted(0.8, 0.25) == pytest.approx(4 + 4 * 0.8 + 2 * 0.25)
    assert m.weighted(0.8) == pytest.approx(4 + 6 * 0.8)  # one offload tier, as before


def test_kv_cost_counts_cpu_blocks_at_offload_weight_and_disk_blocks_at_disk_weight() -> None:
    A, B, C = (EngineKey(f"127.0.0.1:{8000 + i}") for i in range(3))
    policy = KVCostPolicy(PolicyConfig(offload_weight=0.8, disk_weight=0.25))
    matches = {A: Match(100), B: Match(100, offloaded=100), C: Match(100, offloaded=100, disk=100)}
    scores = {s.engine: s for s in policy.score(_req(), [A, B, C], matches, {})}
    assert scores[A].cached_tokens == 1600
    assert scores[B].cached_tokens == 1280
    assert scores[C].cached_tokens == 400
    assert policy.choose(_req(), [B, C], matches, {}).engine == B
    assert policy.choose(_req(), [A, B, C], matches, {}).engine == A
    # A deep disk copy still beats a shallow GPU one when it is worth more.
    matches = {A: Match(20), C: Match(120, offloaded=120, disk=120)}
    assert policy.choose(_req(), [A, C], matches, {}).engine == C


def test_without_a_disk_weight_disk_blocks_weigh_as_offloaded_ones() -> None:
    B, C = EngineKey("127.0.0.1:8001"), EngineKey("127.0.0.1:8002")
    policy = KVCostPolicy(PolicyConfig(offload_weight=0.8, disk_weight=None))
    matches = {B: Match(100, offloaded=100), C: Match(100, offloaded=100, disk=100)}
    scores = {s.engine: s for s in policy.score(_req(), [B, C], matches, {})}
    assert scores[B].cached_tokens == scores[C].cached_tokens == 1280


# --------------------------------------------------------------------------- TensorRT-LLM

TRTLLM = FIXTURES / "trtllm-kv-events"


def _trtllm_expected() -> dict[str, Any]:
    return json.loads((TRTLLM / "expected.json").read_text())


@pytest.mark.parametrize("name", _trtllm_expected()["order"])
def test_trtllm_vectors_decode_to_the_expected_domain_events(name: str) -> None:
    want = _trtllm_expected()[name]
    batch = _read(TRTLLM, name)
    assert batch.data_parallel_rank == want["rank"]
    assert batch.unknown_events == 0
    assert len(batch.events) == len(want["events"])
    for event, expected in zip(batch.events, want["events"], strict=True):
        assert type(event).__name__ == expected["type"]
        for field, value in expected.items():
            if field != "type":
                assert getattr(event, field) == value, (name, field)


def test_trtllm_json_as_trtllm_serve_answers_decodes_like_msgpack() -> None:
    from_json = decode_batch((TRTLLM / "created-and-stored-root.json").read_bytes())
    assert from_json == _read(TRTLLM, "created-and-stored-root")


async def test_trtllm_events_move_blocks_between_levels_and_out() -> None:
    expected = _trtllm_expected()
    index = MemoryIndex()
    ingestor = EventIngestor(index)
    state = StreamState(EngineKey("127.0.0.1:8000", 1), "llama", expected["block_size"])
    keys = block_keys(expected["tokens"], expected["block_size"], seed_for("llama"))
    for name in expected["order"]:
        await ingestor.apply(state, _read(TRTLLM, name))
        blocks, offloaded = expected[name]["match_after"]
        got = index.lookup_now(keys, [state.engine]).get(state.engine)
        assert got == (Match(blocks, offloaded) if blocks else None), name
    # The partial block (16 of 32 tokens) is dropped and counted, never indexed.
    assert ingestor.counters.skipped["block_size_mismatch"] == 1
    assert ingestor.counters.tokenless_blocks == 1  # the level move, resolved by hash
    assert ingestor.counters.skipped["unknown_hash"] == 0
