"""make bench-scale's fleet and its kvroute side (the Dynamo side needs its own virtualenv
and is exercised by the benchmark itself)."""

from __future__ import annotations

from router.bench.scale import measure_kvroute
from router.bench.scale_data import BLOCK, CHAIN, QUERY_BLOCKS, ROOT, Fleet
from router.hashing import block_keys, seed_for


def test_the_fleet_uses_kvroutes_own_keys() -> None:
    assert seed_for("bench-model") == ROOT
    fleet = Fleet(8, 4 * CHAIN)
    for chain in [fleet.query, *fleet.chains(3)]:
        assert chain.keys == block_keys(chain.tokens, BLOCK, ROOT)
        assert len(chain.hashes) == len(chain.keys) == len(chain.tokens) // BLOCK


def test_a_quarter_of_the_chains_are_shared_and_named_alike() -> None:
    fleet = Fleet(64, 8 * CHAIN)
    first = list(fleet.chains(1))
    second = list(fleet.chains(2))
    far = list(fleet.chains(40))  # another sharing group (32 engines each)
    assert first[:2] == second[:2]  # 2 of 8 chains shared, the same blocks and hashes
    assert first[2].keys != second[2].keys
    assert first[0].keys != far[0].keys
    assert fleet.query_depth(0) == QUERY_BLOCKS // 16
    assert fleet.query_depth(60) == QUERY_BLOCKS * 13 // 16 and fleet.query_depth(61) == 0
    assert fleet.entries() == sum(len(c.keys) for e in range(64) for c in fleet.chains(e))


def test_the_kvroute_side_indexes_every_block_and_finds_the_query() -> None:
    result = measure_kvroute(8, 2 * CHAIN, 5)
    assert result["entries"] == Fleet(8, 2 * CHAIN).entries()
    assert result["matches_agree"]
    assert result["ingest_blocks_per_s"] > 0 and result["lookup_p50_us"] > 0
