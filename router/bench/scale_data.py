"""The fleet ``make bench-scale`` indexes, generated the same way in every process.

Standard library and ``xxhash`` only (no ``router`` imports): the Dynamo side of the
benchmark loads this file by its path in its own virtualenv (``build/dynamo/venv``).

A fleet of ``engines`` engines each caches ``blocks`` blocks (block size 16) as chains
of ``CHAIN`` blocks, each chain one prompt prefix from the root: a quarter of an
engine's chains are shared (each shared chain is held by ``SHARED_BY`` engines, or all
of them in a smaller fleet), the rest are its own. A block's key is kvroute's
(``router/hashing.py``: XXH3-64 of the block's little-endian token ids, seeded with the
previous block's key); its engine hash (what vLLM's KV events name it by) is the same
for every engine holding it, as vLLM's content hashes are. On top, every fourth engine
holds a prefix of the 8,192-token query (512 blocks), of depth 1/16 to 16/16.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

BLOCK = 16
CHAIN = 64
SHARED_SHARE = 4
"""One chain in this many is shared."""
SHARED_BY = 32
QUERY_BLOCKS = 512
ROOT = xxhash.xxh3_64_intdigest(b"kvroute-v1\x00bench-model\x00")
"""kvroute's seed for the model ``bench-model`` (``router.hashing.seed_for``)."""


def chain_keys(tokens: array, parent: int = ROOT) -> list[int]:
    """kvroute's block keys of ``tokens`` (array('I'), a whole number of blocks)."""
    data = tokens.tobytes()
    step = BLOCK * 4
    keys = []
    key = parent
    for off in range(0, len(data), step):
        key = xxhash.xxh3_64_intdigest(data[off : off + step], key)
        keys.append(key)
    return keys


def engine_hash(key: int) -> int:
    """The engines' name for a block (the same on every engine, like vLLM's)."""
    return xxhash.xxh3_64_intdigest(key.to_bytes(8, "little"), 0x5EED)


def _stable(name: tuple[object, ...]) -> int:
    return xxhash.xxh32_intdigest(repr(name).encode())


@dataclass(frozen=True)
class Chain:
    """One stored prefix: its tokens, kvroute's keys and the engines' hashes."""

    tokens: array
    keys: list[int]
    hashes: list[int]


def _chain(seed: int, blocks: int = CHAIN) -> Chain:
    """A chain of ``blocks`` blocks of random 32-bit token ids drawn from ``seed``."""
    tokens = array("I")
    tokens.frombytes(random.Random(seed).randbytes(blocks * BLOCK * 4))
    keys = chain_keys(tokens)
    return Chain(tokens, keys, [engine_hash(k) for k in keys])


class Fleet:
    """What every engine of the fleet caches, and the query."""

    def __init__(self, engines: int, blocks: int) -> None:
        self.engines = engines
        self.blocks = blocks
        """Blocks each engine caches, besides its part of the query."""
        self.chains_per_engine = max(blocks // CHAIN, 1)
        self.shared_by = min(SHARED_BY, engines)
        self._shared: dict[tuple[int, int], Chain] = {}
        self.query = _chain(_stable(("query",)), QUERY_BLOCKS)
        """The 8,192-token query prompt."""

    def chains(self, engine: int) -> Iterator[Chain]:
        """The chains one engine stores (shared ones first), then its part of the query."""
        per = self.chains_per_engine
        shared = per // SHARED_SHARE
        group = engine // self.shared_by
        for k in range(shared):
            chain = self._shared.get((group, k))
            if chain is None:
                chain = self._shared[group, k] = _chain(_stable(("shared", group, k)))
            yield chain
        for k in range(per - shared):
            yield _chain(_stable(("own", engine, k)))
        depth = self.query_depth(engine)
        if depth:
            q = self.query
            yield Chain(q.tokens[: depth * BLOCK], q.keys[:depth], q.hashes[:depth])

    def query_depth(self, engine: int) -> int:
        """Blocks of the query ``engine`` holds (0 for three engines in four)."""
        if engine % 4:
            return 0
        return QUERY_BLOCKS * (engine % 16 + 1) // 16

    def entries(self) -> int:
        """(block, engine) entries of the whole fleet."""
        per = self.chains_per_engine * CHAIN
        return sum(per + self.query_depth(e) for e in range(self.engines))


def rss_bytes() -> int:
    """This process's resident set size (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def percentiles_us(samples: list[float]) -> tuple[float, float]:
    """p50 and p99 of ``samples`` (seconds), in microseconds."""
    samples = sorted(samples)
    return samples[len(samples) // 2] * 1e6, samples[max(int(len(samples) * 0.99) - 1, 0)] * 1e6


def row(
    index: str,
    fleet: Fleet,
    applied: int,
    grown: int,
    spent: float,
    lookups: list[float],
    cleared: float,
    found: dict[int, int],
) -> dict[str, object]:
    """One line of the benchmark's table: what both indexes report alike."""
    lookup = percentiles_us(lookups)
    expected = {e: fleet.query_depth(e) for e in range(fleet.engines) if fleet.query_depth(e)}
    return {
        "index": index,
        "engines": fleet.engines,
        "entries": applied,
        "bytes_per_entry": grown / applied,
        "ingest_blocks_per_s": applied / spent,
        "replay_s": spent,
        "lookup_p50_us": lookup[0],
        "lookup_p99_us": lookup[1],
        "clear_engine_ms": cleared * 1e3,
        "matches_agree": found == expected,
    }
