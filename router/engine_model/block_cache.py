"""The engine's paged KV cache: fixed-size blocks, prefix reuse by hash, LRU eviction.

Modelled on vLLM's ``BlockPool``. Every block is either *referenced* (held by one or
more sequences) or *free*. Free blocks sit in one queue in release order; allocation
takes never-used blocks first, then the head of that queue, and a taken block that
still carries a hash is evicted from the prefix cache (``BlockRemoved``). Only
unreferenced blocks are ever evicted. A sequence releases its blocks last block first,
so the tail of a prompt is evicted before its shared head.

Costs are O(blocks touched): never-used blocks are a counter, not a list, and per-block
state exists only for blocks that have been used.

An optional offload tier (``num_cpu_blocks``, like vLLM's CPU offloading or SGLang's
HiCache host pool) keeps the hashes of blocks evicted from the GPU cache, least recently
demoted first out. A demotion is published as vLLM's offloading connectors publish it: a
*tokenless* ``BlockStored`` on ``CPU`` (the block's engine hash alone) before the GPU
``BlockRemoved``; a block leaving the tier is a ``BlockRemoved`` on ``CPU``. A prefix hit
on the tier loads the block back (the engine registers it on the GPU again, keeping the
CPU copy, as vLLM does).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from router.events.types import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)


class BlockCache:
    """Block allocation, reference counts and the hash → block prefix index."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        emit_events: bool = True,
        num_cpu_blocks: int = 0,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if num_cpu_blocks < 0:
            raise ValueError("num_cpu_blocks must be >= 0")
        self.num_cpu_blocks = num_cpu_blocks
        #: Hashes held by the offload tier, least recently demoted first.
        self._cpu: OrderedDict[int, None] = OrderedDict()
        #: Publish demotions with their tokens (SGLang's HiCache shape) rather than
        #: tokenless (vLLM's offloading connectors' placeholder).
        self.offload_tokens = False
        #: With an offload tier: what each cached block was stored with (parent hash,
        #: tokens, extra-keys entry, LoRA id and name), for self-describing demotions.
        self._stored: dict[int, tuple[int | None, list[int], Any, int | None, str | None]] = {}
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.emit_events = emit_events
        #: Domain events not yet taken by the engine (see ``take_events``).
        self.events: list[KVEvent] = []
        self._next_fresh = 0
        self._free: OrderedDict[int, None] = OrderedDict()
        self._refs: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}

    # ------------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        """Blocks that an allocation may take (never used, or unreferenced and evictable)."""
        return self.num_blocks - self._next_fresh + len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by sequences (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - self.num_free / self.num_blocks

    @property
    def num_cached(self) -> int:
        """Blocks currently reachable by hash."""
        return len(self._block_of)

    def match(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes`` (at most ``max_blocks``)."""
        found: list[int] = []
        block_of = self._block_of
        for h in hashes[:max_blocks]:
            block = block_of.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def match_offloaded(self, hashes: Sequence[int], start: int, max_blocks: int) -> int:
        """How many of ``hashes[start:max_blocks]`` the offload tier holds in a row."""
        cpu = self._cpu
        if not cpu:
            return 0
        n = 0
        for h in hashes[start:max_blocks]:
            if h not in cpu:
                break
            n += 1
        return n

    @property
    def num_offloaded(self) -> int:
        """Blocks the offload tier holds."""
        return len(self._cpu)

    def can_allocate(self, count: int, touching: Sequence[int] = ()) -> bool:
        """Whether ``count`` new blocks fit once the cached blocks ``touching`` are taken."""
        refs = self._refs
        reclaimed = sum(1 for b in touching if b not in refs)
        return count <= self.num_free - reclaimed

    # ------------------------------------------------------------------ ownership

    def touch(self, blocks: Sequence[int]) -> None:
        """Take one more reference on cached blocks (a prefix hit)."""
        refs = self._refs
        for b in blocks:
            n = refs.get(b, 0)
            if n == 0:
                del self._free[b]
            refs[b] = n + 1

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks, evicting the least recently released cached ones."""
        if count > self.num_free:
            raise ValueError(f"cannot allocate {count} blocks, {self.num_free} free")
        fresh = min(count, self.num_blocks - self._next_fresh)
        blocks = list(range(self._next_fresh, self._next_fresh + fresh))
        self._next_fresh += fresh
        evicted: list[int] = []
        for _ in range(count - fresh):
            block, _unused = self._free.popitem(last=False)
            h = self._hash_of.pop(block, None)
            if h is not None:
                del self._block_of[h]
                evicted.append(h)
            blocks.append(block)
        refs = self._refs
        for b in blocks:
            refs[b] = 1
        if evicted:
            if self.num_cpu_blocks:
                self._demote(evicted)
            if self.emit_events:
                self.events.append(BlockRemoved(evicted, MEDIUM_GPU))
        return blocks

    def _demote(self, hashes: list[int]) -> None:
        """Copy evicted blocks to the offload tier, dropping its oldest when full."""
        cpu = self._cpu
        fresh = [h for h in hashes if h not in cpu]
        for h in hashes:
            cpu[h] = None
            cpu.move_to_end(h)
        dropped: list[int] = []
        while len(cpu) > self.num_cpu_blocks:
            h, _ = cpu.popitem(last=False)
            dropped.append(h)
        if not self.emit_events:
            return
        kept = [h for h in fresh if h in cpu]
        if kept and not self.offload_tokens:
            # The offloading connectors' shape: engine hashes only, no tokens.
            self.events.append(BlockStored(kept, None, [], 0, None, MEDIUM_CPU))
        elif kept:
            for h in kept:
                known = self._stored.get(h)
                if known is None:
                    continue
                parent, tokens, extra, lora_id, lora_name = known
                self.events.append(
                    BlockStored(
                        [h],
                        parent,
                        tokens,
                        self.block_size,
                        lora_id,
                        MEDIUM_CPU,
                        lora_name,
                        [extra] if extra is not None else None,
                    )
                )
        gone = [h for h in dropped if h not in fresh]
        if gone:
            self.events.append(BlockRemoved(gone, MEDIUM_CPU))
        for h in dropped:
            if h not in self._block_of:
                self._stored.pop(h, None)

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block; unreferenced ones become evictable.

        Blocks are queued last first so that a sequence's tail is evicted before its head.
        """
        refs = self._refs
        free = self._free
        for b in reversed(blocks):
            n = refs[b] - 1
            if n:
                refs[b] = n
            else:
                del refs[b]
                free[b] = None

    # ------------------------------------------------------------------ prefix index

    def store(
        self,
        blocks: Sequence[int],
        hashes: Sequence[int],
        parent_hash: int | None,
        token_ids: Sequence[int],
        lora_id: int | None = None,
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> None:
        """Make newly filled ``blocks`` reachable by their ``hashes``.

        ``token_ids`` covers exactly these blocks; ``extra_keys`` holds one entry per
        block (or is None). A hash that another block already serves is not registered
        twice (the duplicate stays private to its sequence), so runs of newly registered
        blocks become one ``BlockStored`` each, chained to the previous block's hash.
        """
        hash_of = self._hash_of
        block_of = self._block_of
        runs: list[tuple[int, int]] = []
        run_start = -1
        for i, (block, h) in enumerate(zip(blocks, hashes, strict=True)):
            if h in block_of:
                if run_start >= 0:
                    runs.append((run_start, i))
                    run_start = -1
                continue
            block_of[h] = block
            hash_of[block] = h
            if run_start < 0:
                run_start = i
        if run_start >= 0:
            runs.append((run_start, len(hashes)))
        bs = self.block_size
        if self.num_cpu_blocks and self.offload_tokens:
            for start, end in runs:
                for i in range(start, end):
                    self._stored[hashes[i]] = (
                        hashes[i - 1] if i > 0 else parent_hash,
                        list(token_ids[i * bs : (i + 1) * bs]),
                        extra_keys[i] if extra_keys is not None else None,
                        lora_id,
                        lora_name,
                    )
        if not self.emit_events:
            return
        for start, end in runs:
            self.events.append(
                BlockStored(
                    block_hashes=list(hashes[start:end]),
                    parent_block_hash=hashes[start - 1] if start > 0 else parent_hash,
                    token_ids=list(token_ids[start * bs : end * bs]),
                    block_size=bs,
                    lora_id=lora_id,
                    medium=MEDIUM_GPU,
                    lora_name=lora_name,
                    extra_keys=list(extra_keys[start:end]) if extra_keys is not None else None,
                )
            )

    def reset(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache).

        Refused (False) while any block is referenced, as in vLLM.
        """
        if self._refs:
            return False
        self._next_fresh = 0
        self._free.clear()
        self._hash_of.clear()
        self._block_of.clear()
        self._cpu.clear()
        self._stored.clear()
        if self.emit_events:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """The events produced since the last call, oldest first."""
        events, self.events = self.events, []
        return events
