"""Apply decoded KV events of one engine stream to the index.

Engines name blocks by their own hashes (vLLM's default is a salted sha256 that cannot
be reproduced outside the engine), so the router treats them as opaque ids and
recomputes its own keys from the ``token_ids`` each ``BlockStored`` carries, chaining
from the parent block's key. The map engine-hash -> key, kept per stream and per tier,
is what lets ``BlockRemoved`` (which carries only engine hashes) and child blocks be
applied. A parent the map does not know is a gap: the event is skipped and counted
(the subscriber's replay repairs gaps it can see).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.events.types import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from router.hashing import block_keys, seed_for
from router.index.base import KVIndex
from router.types import EngineKey, Tier


def cache_salt_of(event: BlockStored) -> str | None:
    """The cache salt vLLM folds into the first block's extra keys, if any.

    vLLM's extra keys for a block are (multimodal hashes..., LoRA name, cache salt on the
    first block only, prompt-embedding hashes...). The salt is the last string that is
    not the LoRA name; multimodal prompts cannot be matched by token ids anyway.
    """
    if not event.extra_keys:
        return None
    first: Any = event.extra_keys[0]
    if not isinstance(first, (list, tuple)):
        return None
    strings = [k for k in first if isinstance(k, str) and k != event.lora_name]
    return strings[-1] if strings else None


@dataclass(slots=True)
class StreamState:
    """What the router knows about one engine's event stream (one DP rank)."""

    engine: EngineKey
    namespace: str
    """Model name the engine serves; seeds root keys of blocks without a LoRA adapter."""
    block_size: int | None = None
    """Expected block size; learned from the first event when None."""
    hashes: tuple[dict[int, int], dict[int, int]] = field(default_factory=lambda: ({}, {}))
    """Engine hash -> block key, per tier (GPU, offloaded)."""
    ignored_groups: set[int] = field(default_factory=set)
    last_seq: int | None = None

    def forget_blocks(self) -> None:
        for table in self.hashes:
            table.clear()

    def key_of(self, engine_hash: int) -> int | None:
        gpu, offloaded = self.hashes
        key = gpu.get(engine_hash)
        return key if key is not None else offloaded.get(engine_hash)


@dataclass(slots=True)
class IngestCounters:
    """What ingestion did, for metrics (read by the metrics layer, never reset)."""

    events: Counter[str] = field(default_factory=Counter)
    """Applied events by type."""
    skipped: Counter[str] = field(default_factory=Counter)
    """Skipped events by reason: unknown_parent, ignored_group, block_size_mismatch,
    malformed, unknown_hash."""
    blocks_stored: int = 0
    blocks_removed: int = 0


BlockSizeListener = Callable[[EngineKey, int, int], None]
"""Called with (engine, expected, got) when an engine's events use another block size."""


class EventIngestor:
    """Turns one stream's domain events into index writes."""

    def __init__(
        self,
        index: KVIndex,
        counters: IngestCounters | None = None,
        on_block_size_mismatch: BlockSizeListener | None = None,
    ) -> None:
        self.index = index
        self.counters = counters or IngestCounters()
        self._on_mismatch = on_block_size_mismatch

    async def apply(self, state: StreamState, batch: EventBatch) -> None:
        """Apply every event of ``batch`` in order."""
        for event in batch.events:
            if isinstance(event, BlockStored):
                await self._stored(state, event)
            elif isinstance(event, BlockRemoved):
                await self._removed(state, event)
            elif isinstance(event, AllBlocksCleared):
                await self.clear(state)
                self.counters.events["AllBlocksCleared"] += 1

    async def clear(self, state: StreamState) -> None:
        """Forget everything the engine held (cleared cache, restart, lost history)."""
        state.forget_blocks()
        await self.index.clear(state.engine)

    async def _stored(self, state: StreamState, event: BlockStored) -> None:
        skipped = self.counters.skipped
        if not event.indexed:
            if event.group_idx is not None:
                state.ignored_groups.add(event.group_idx)
            skipped["ignored_group"] += 1
            return
        if state.block_size is None:
            state.block_size = event.block_size
        elif event.block_size != state.block_size:
            skipped["block_size_mismatch"] += 1
            if self._on_mismatch is not None:
                self._on_mismatch(state.engine, state.block_size, event.block_size)
            return
        nblocks = len(event.block_hashes)
        if nblocks == 0 or len(event.token_ids) != nblocks * event.block_size:
            skipped["malformed"] += 1
            return
        if event.parent_block_hash is None:
            root = seed_for(event.lora_name or state.namespace, cache_salt_of(event))
        else:
            parent = state.key_of(event.parent_block_hash)
            if parent is None:
                skipped["unknown_parent"] += 1
                return
            root = parent
        keys = block_keys(event.token_ids, event.block_size, root)
        tier = Tier.from_medium(event.medium)
        state.hashes[tier].update(zip(event.block_hashes, keys, strict=True))
        await self._store(state, event.block_hashes, keys, tier)
        self.counters.events["BlockStored"] += 1
        self.counters.blocks_stored += nblocks

    async def _store(
        self, state: StreamState, hashes: list[int], keys: list[int], tier: Tier
    ) -> None:
        """Record stored blocks in the index. A hook: the Redis event writer also keeps
        the engine's hashes, so that a writer taking the stream over can apply removals."""
        await self.index.add(state.engine, keys, tier)

    async def _removed(self, state: StreamState, event: BlockRemoved) -> None:
        if event.group_idx is not None and event.group_idx in state.ignored_groups:
            self.counters.skipped["ignored_group"] += 1
            return
        tier = Tier.from_medium(event.medium)
        table = state.hashes[tier]
        keys = []
        for engine_hash in event.block_hashes:
            key = table.pop(engine_hash, None)
            if key is not None:
                keys.append(key)
        unknown = len(event.block_hashes) - len(keys)
        if unknown:
            self.counters.skipped["unknown_hash"] += unknown
        if keys:
            await self.index.remove(state.engine, keys, tier)
        self.counters.events["BlockRemoved"] += 1
        self.counters.blocks_removed += len(keys)
