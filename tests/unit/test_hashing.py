"""Block keys (router/hashing.py): chained xxh3_64 over little-endian uint32 tokens,
full blocks only, seeded by model / LoRA adapter / cache_salt, and stable across
processes and releases (router replicas share them through Redis)."""

from __future__ import annotations

import struct
from array import array

import pytest
import xxhash

from router.hashing import block_keys, cacheable_blocks, chain, extend_keys, seed_for

TOKENS = [(i * 7919 + 13) % 131_072 for i in range(8_192)]


def reference_keys(tokens: list[int], block_size: int, seed: int) -> list[int]:
    """The documented rule, written independently: key[i] = xxh3_64(le_u32(block i),
    seed=key[i-1]), key[-1] = seed; full blocks only."""
    keys, key = [], seed
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        key = xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}I", *block), key)
        keys.append(key)
    return keys


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_keys_follow_the_documented_chain(block_size: int) -> None:
    seed = seed_for("model")
    assert block_keys(TOKENS, block_size, seed) == reference_keys(TOKENS, block_size, seed)


def test_keys_are_independent_of_the_input_container() -> None:
    seed = seed_for("model")
    as_list = block_keys(TOKENS, 16, seed)
    assert as_list == block_keys(tuple(TOKENS), 16, seed)
    assert as_list == block_keys(array("I", TOKENS), 16, seed)
    assert as_list == block_keys(struct.pack(f"<{len(TOKENS)}I", *TOKENS), 16, seed)


def test_seeds_and_keys_are_the_same_in_every_process_and_release() -> None:
    """Pinned values: replicas, and routers of two versions during a rollout, compare
    keys through a shared Redis index; a change to the derivation must change the
    ``kvroute-v1`` tag in router/hashing.py (and these values) on purpose."""
    assert seed_for("kvroute-emulated") == 0x90C596DE840C866F
    assert seed_for("kvroute-emulated", "tenant-1") == 0x7993B1B18A64C649
    assert block_keys(list(range(32)), 16, seed_for("kvroute-emulated")) == [
        0x5B8E0A24F6924CF6,
        0xC69803D89128D326,
    ]


def test_only_full_blocks_are_hashed_and_max_blocks_caps() -> None:
    seed = seed_for("m")
    assert len(block_keys(TOKENS[:15], 16, seed)) == 0
    assert len(block_keys(TOKENS[:16], 16, seed)) == 1
    assert len(block_keys(TOKENS[:47], 16, seed)) == 2
    assert len(block_keys(TOKENS, 16, seed)) == 512
    assert block_keys(TOKENS, 16, seed, max_blocks=3) == block_keys(TOKENS[:48], 16, seed)
    with pytest.raises(ValueError):
        block_keys(TOKENS, 0, seed)


def test_a_key_identifies_the_whole_prefix() -> None:
    seed = seed_for("m")
    base = block_keys(TOKENS[:160], 16, seed)
    # A prefix's keys are a prefix of the keys.
    assert block_keys(TOKENS[:64], 16, seed) == base[:4]
    # Changing one token of block 5 changes key 5 and every later key, none before.
    changed = list(TOKENS[:160])
    changed[5 * 16 + 3] += 1
    other = block_keys(changed, 16, seed)
    assert other[:5] == base[:5]
    assert all(a != b for a, b in zip(other[5:], base[5:], strict=True))
    # The same block content at another position has another key (chained, not local).
    repeated = TOKENS[:16] * 3
    keys = block_keys(repeated, 16, seed)
    assert len(set(keys)) == 3


def test_chain_and_extend_continue_from_a_parent_key() -> None:
    seed = seed_for("m")
    keys = block_keys(TOKENS[:64], 16, seed)
    assert chain(keys[1], TOKENS[32:48]) == keys[2]
    assert extend_keys(keys[0], TOKENS[16:64], 16) == keys[1:]


def test_model_adapter_and_cache_salt_each_seed_the_chain_apart() -> None:
    prompt = TOKENS[:64]
    seeds = {
        "model-a": seed_for("model-a"),
        "model-b": seed_for("model-b"),
        "adapter of model-a": seed_for("sql-adapter"),
        "model-a salted": seed_for("model-a", "tenant-1"),
        "model-a other salt": seed_for("model-a", "tenant-2"),
    }
    assert len(set(seeds.values())) == len(seeds)
    first_keys = {name: block_keys(prompt, 16, s)[0] for name, s in seeds.items()}
    assert len(set(first_keys.values())) == len(seeds)
    # No salt and None are the same namespace.
    assert seed_for("model-a") == seed_for("model-a", None)
    # The separator keeps (namespace, salt) pairs from colliding by concatenation.
    assert seed_for("ab", "c") != seed_for("a", "bc")


def test_token_ids_outside_uint32_are_refused() -> None:
    with pytest.raises(OverflowError):
        block_keys([1, 2, -1, 4], 2, 0)
    with pytest.raises(OverflowError):
        block_keys([1, 2, 2**32, 4], 2, 0)


def test_the_last_prompt_token_is_never_cacheable() -> None:
    assert cacheable_blocks(2_000, 16) == 124  # 1,984 tokens
    assert cacheable_blocks(32, 16) == 1
    assert cacheable_blocks(33, 16) == 2
    assert cacheable_blocks(1, 16) == cacheable_blocks(0, 16) == 0


def test_media_extra_keys_fold_into_their_blocks_as_documented() -> None:
    seed = seed_for("model")
    extra = {2: [("img-a", 5)], 3: [("img-a", -11), b"\x01\x02"]}
    plain = reference_keys(TOKENS[:80], 16, seed)
    keys = block_keys(TOKENS[:80], 16, seed, extra=extra)
    assert keys[:2] == plain[:2]  # blocks before the first item keep today's keys
    pairs = b"mm" + struct.pack("<I", 5) + b"img-a" + struct.pack("<q", 5)
    k2 = xxhash.xxh3_64_intdigest(
        pairs, xxhash.xxh3_64_intdigest(struct.pack("<16I", *TOKENS[32:48]), plain[1])
    )
    assert keys[2] == k2
    tail = b"mm" + struct.pack("<I", 5) + b"img-a" + struct.pack("<q", -11)
    tail += b"pe" + struct.pack("<I", 2) + b"\x01\x02"
    k3 = xxhash.xxh3_64_intdigest(
        tail, xxhash.xxh3_64_intdigest(struct.pack("<16I", *TOKENS[48:64]), k2)
    )
    assert keys[3] == k3
    assert keys[4] == chain(k3, TOKENS[64:80])
    assert chain(plain[1], TOKENS[32:48], extra[2]) == k2
