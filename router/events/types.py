"""Domain KV-cache events: one type per event, whatever wire shape they came in."""

from __future__ import annotations

from typing import Any

import msgspec

#: Tiers an engine reports in ``medium`` (``router.types.Tier.from_medium`` maps every
#: known name). Anything else is a slower offload tier.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
#: vLLM's disk / shared-storage tier.
MEDIUM_STORAGE = "STORAGE"

#: ``kv_cache_spec_kind`` values that the index records. Absent means full attention.
INDEXED_SPEC_KINDS = frozenset({None, "full_attention", "FullAttentionSpec"})


class BlockStored(msgspec.Struct, gc=False):
    """Blocks became resident. Hashes are the engine's own opaque 64-bit ids.

    A *tokenless* store (no ``token_ids``, ``block_size`` 0 allowed: vLLM's offloading
    connectors' placeholder for a block copied GPU -> CPU) names blocks the stream
    already knows by hash; the ingestor resolves them through its hash -> key map.
    """

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
    locality: str | None = None
    """``LOCAL``/``REMOTE`` relative to the publisher (vLLM 0.32); None: unspecified."""
    ownership: str | None = None
    """The secondary offloading tier that produced the event (vLLM 0.32), if any."""

    @property
    def tokenless(self) -> bool:
        """A store that carries no tokens (resolved by engine hash)."""
        return not self.token_ids

    @property
    def indexed(self) -> bool:
        """Whether the index records this event (full-attention groups only)."""
        return self.kv_cache_spec_kind in INDEXED_SPEC_KINDS


class BlockRemoved(msgspec.Struct, gc=False):
    """Blocks were evicted from ``medium`` (None means the engine's primary tier)."""

    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None
    all_tiers: bool = False
    """The blocks left the engine altogether, whatever tiers held them (TensorRT-LLM's
    ``removed``: it names no tier); ``medium`` is then ignored."""


class AllBlocksCleared(msgspec.Struct, gc=False):
    """The engine dropped everything it held (prefix-cache reset, restart)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, gc=False):
    """One published message: a timestamp, its events, and the DP rank that sent it."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
    unknown_events: int = 0
    """Events of a type this decoder does not know: dropped, counted, never fatal."""
    unknown_fields: int = 0
    """Fields of known events this decoder does not read (newer engines add some)."""
