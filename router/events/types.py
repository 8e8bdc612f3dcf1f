"""Domain KV-cache events: one type per event, whatever wire shape they came in."""

from __future__ import annotations

from typing import Any

import msgspec

#: Tiers an engine reports in ``medium``. Anything else is a slower offload tier.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"

#: ``kv_cache_spec_kind`` values that the index records. Absent means full attention.
INDEXED_SPEC_KINDS = frozenset({None, "full_attention", "FullAttentionSpec"})


class BlockStored(msgspec.Struct, gc=False):
    """Blocks became resident. Hashes are the engine's own opaque 64-bit ids."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None

    @property
    def indexed(self) -> bool:
        """Whether the index records this event (full-attention groups only)."""
        return self.kv_cache_spec_kind in INDEXED_SPEC_KINDS


class BlockRemoved(msgspec.Struct, gc=False):
    """Blocks were evicted from ``medium`` (None means the engine's primary tier)."""

    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, gc=False):
    """The engine dropped everything it held (prefix-cache reset, restart)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, gc=False):
    """One published message: a timestamp, its events, and the DP rank that sent it."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
