"""Apply decoded KV events of one engine stream to the index.

Engines name blocks by their own hashes (vLLM's default is a salted sha256 that cannot
be reproduced outside the engine), so the router treats them as opaque ids and
recomputes its own keys from the ``token_ids`` each ``BlockStored`` carries, chaining
from the parent block's key and folding in each block's media ``extra_keys`` as the
request side does. The map engine-hash -> key, kept per stream and per tier,
is what lets ``BlockRemoved`` (which carries only engine hashes) and child blocks be
applied. A parent the map does not know is a gap: the event is skipped and counted
(the subscriber's replay repairs gaps it can see).

Tiers (``router.types.Tier``: GPU, CPU, disk/remote) come from each event's ``medium``
and ``locality``; a block may be held on several at once, and a removal from one tier
leaves the others. A *tokenless* ``BlockStored`` (no ``token_ids``: what vLLM's
offloading connectors send when they copy a block GPU -> CPU) carries only engine
hashes: each resolves through the map (any tier) to the key its tokens gave it, and
hashes the map does not know are skipped and counted (``tokenless_unresolved``).

The map is a compiled ``router._native.BlockMap`` (an insertion-ordered table of 64-bit
ints, about 26 bytes an entry) where the helper is built, else a dict; both are
insertion-ordered and answer the same calls. It is bounded (``max_blocks_per_engine``,
per tier): past it the oldest eighth of
the hashes is forgotten (``IngestCounters.forgotten_hashes``) and their blocks leave the
index with them, so the index never holds a block whose removal the router could no
longer apply; a later removal of a forgotten hash is counted as ``unknown_hash``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from router.events.types import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from router.events.vllm import SGLANG_SALT_PREFIX
from router.hashing import ExtraKey, block_keys, native_helper, seed_for
from router.index.base import KVIndex, pop_oldest, store_newest, trimmed_size
from router.metric_catalogue import (
    KV_EVENT_HASHES_FORGOTTEN,
    KV_EVENT_UNKNOWN_FIELDS,
    KV_EVENTS,
    KV_EVENTS_BLOCK_SIZE_MISMATCH,
    KV_EVENTS_SKIPPED,
)
from router.types import EngineKey, Tier

if TYPE_CHECKING:
    from router.metric_catalogue import StateFamily


def _entries(event: BlockStored) -> list[list[Any]]:
    """Each block's extra keys as a list (an absent or null entry: none)."""
    extra = event.extra_keys or []
    return [list(e) if isinstance(e, (list, tuple)) else [] for e in extra]


def _strings(entry: list[Any], lora_name: str | None) -> list[str]:
    """An entry's bare strings, less the LoRA name vLLM puts first when there is one."""
    strings = [k for k in entry if isinstance(k, str)]
    if lora_name is not None and strings and strings[0] == lora_name:
        strings = strings[1:]
    return strings


def cache_salt_of(event: BlockStored) -> str | None:
    """The cache salt vLLM folds into the first block's extra keys, if any.

    vLLM publishes a block's extra keys untagged, in this order: the LoRA name (when
    ``lora_name`` is set), ``(mm_identifier, offset)`` pairs, the cache salt (first block
    of a prompt only), prompt-embedding digests (bytes). The salt is the bare string
    after the LoRA name. SGLang puts its salt there too, prefixed ``dynamo-cache-salt:``
    (Dynamo's convention), which is dropped.
    """
    entries = _entries(event)
    if not entries:
        return None
    strings = _strings(entries[0], event.lora_name)
    if not strings:
        return None
    salt = strings[-1]
    return salt.removeprefix(SGLANG_SALT_PREFIX)


def block_extras_of(event: BlockStored) -> dict[int, list[ExtraKey]]:
    """Per block of the event, the extra keys folded into its router key: media pairs
    ``(identifier, offset)`` and prompt-embedding digests, as the request side folds
    them (``router.media``). The LoRA name and the salt seed the chain instead."""
    extras: dict[int, list[ExtraKey]] = {}
    for i, entry in enumerate(_entries(event)):
        keys: list[ExtraKey] = []
        for key in entry:
            if isinstance(key, bytes):
                keys.append(key)
            elif (
                isinstance(key, (list, tuple))
                and len(key) == 2
                and isinstance(key[0], str)
                and isinstance(key[1], int)
                and not isinstance(key[1], bool)
            ):
                keys.append((key[0], key[1]))
        if keys:
            extras[i] = keys
    return extras


_BLOCK_MAP: Any = getattr(native_helper(), "BlockMap", None)

HashMap = dict[int, int]
"""Engine hash -> block key, oldest stored first (a dict, or the compiled ``BlockMap``
that answers the same calls)."""


def hash_maps() -> tuple[HashMap, HashMap, HashMap]:
    """One empty engine-hash map per tier: compiled where the helper is built."""
    if _BLOCK_MAP is None:
        return ({}, {}, {})
    return (_BLOCK_MAP(), _BLOCK_MAP(), _BLOCK_MAP())


@dataclass(slots=True)
class StreamState:
    """What the router knows about one engine's event stream (one DP rank)."""

    engine: EngineKey
    namespace: str
    """Model name the engine serves; seeds root keys of blocks without a LoRA adapter."""
    block_size: int | None = None
    """Expected block size; learned from the first event when None."""
    hashes: tuple[HashMap, ...] = field(default_factory=hash_maps)
    """Engine hash -> block key, per tier (GPU, CPU, disk: indexed by ``Tier``)."""
    ignored_groups: set[int] = field(default_factory=set)
    last_seq: int | None = None

    def forget_blocks(self) -> None:
        for table in self.hashes:
            table.clear()

    def key_of(self, engine_hash: int) -> int | None:
        """The block key of ``engine_hash`` in whichever tier holds it (None: unknown)."""
        for table in self.hashes:
            key = table.get(engine_hash)
            if key is not None:
                return key
        return None


@dataclass(slots=True)
class IngestCounters:
    """What ingestion did, for metrics (read by the metrics layer, never reset)."""

    events: Counter[str] = field(default_factory=Counter)
    """Applied events by type."""
    skipped: Counter[str] = field(default_factory=Counter)
    """Skipped events by reason: unknown_parent, ignored_group, block_size_mismatch,
    malformed, unknown_hash, unknown_type, tokenless_unresolved (blocks of a tokenless
    store whose engine hash the stream's map does not know)."""
    unknown_fields: int = 0
    """Fields of applied events this version does not read (ignored)."""
    blocks_stored: int = 0
    blocks_removed: int = 0
    tokenless_blocks: int = 0
    """Blocks of tokenless stores resolved by engine hash and applied."""
    forgotten_hashes: int = 0
    """Engine hashes dropped from full per-stream maps (``max_blocks_per_engine``)."""
    block_size_mismatches: Counter[EngineKey] = field(default_factory=Counter)
    """BlockStored events dropped per engine stream because their block size is not the
    engine's."""

    def metric_families(self, fleet: Container[str] | None = None) -> Iterator[StateFamily]:
        """Events applied and skipped, hashes forgotten, fields ignored, and block-size
        mismatches of the engines in ``fleet`` (their endpoints; None: every engine's)."""
        types = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
        yield KV_EVENTS.labelled(((t,), self.events.get(t, 0)) for t in types)
        yield KV_EVENTS_SKIPPED.labelled(((r,), n) for r, n in sorted(self.skipped.items()))
        yield KV_EVENT_HASHES_FORGOTTEN.value(self.forgotten_hashes)
        yield KV_EVENT_UNKNOWN_FIELDS.value(self.unknown_fields)
        yield KV_EVENTS_BLOCK_SIZE_MISMATCH.labelled(
            ((key.label,), n)
            for key, n in sorted(self.block_size_mismatches.items())
            if fleet is None or key.endpoint in fleet
        )


BlockSizeListener = Callable[[EngineKey, int, int], None]
"""Called with (engine, expected, got) when an event of an engine's stream uses another
block size than the stream's; the event itself is dropped."""


class EventIngestor:
    """Turns one stream's domain events into index writes."""

    def __init__(
        self,
        index: KVIndex,
        counters: IngestCounters | None = None,
        on_block_size_mismatch: BlockSizeListener | None = None,
        max_blocks_per_engine: int = 0,
    ) -> None:
        """``max_blocks_per_engine``: engine hashes a stream's map keeps per tier (0: no
        limit); the oldest eighth goes when it is full."""
        self.index = index
        self.counters = counters or IngestCounters()
        self._on_mismatch = on_block_size_mismatch
        self.max_blocks_per_engine = max_blocks_per_engine

    def _remember(self, table: HashMap, hashes: list[int], keys: list[int]) -> list[int]:
        """Map ``hashes`` to ``keys`` in a stream's table of one tier, newest last; past
        the cap, forget the oldest eighth. Returns the forgotten hashes' keys."""
        cap = self.max_blocks_per_engine
        store_newest(table, hashes, keys, reorder=bool(cap))
        if not cap or len(table) <= cap:
            return []
        excess = len(table) - trimmed_size(cap)
        forgotten = pop_oldest(table, excess)
        self.counters.forgotten_hashes += excess
        return forgotten

    async def apply(self, state: StreamState, batch: EventBatch) -> None:
        """Apply every event of ``batch`` in order."""
        if batch.unknown_events:
            self.counters.skipped["unknown_type"] += batch.unknown_events
        self.counters.unknown_fields += batch.unknown_fields
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
        if event.tokenless:
            await self._stored_by_hash(state, event)
            return
        if state.block_size is None:
            state.block_size = event.block_size
        elif event.block_size != state.block_size:
            skipped["block_size_mismatch"] += 1
            self.counters.block_size_mismatches[state.engine] += 1
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
        keys = block_keys(event.token_ids, event.block_size, root, extra=block_extras_of(event))
        tier = Tier.from_medium(event.medium, event.locality, event.ownership)
        forgotten = self._remember(state.hashes[tier], event.block_hashes, keys)
        await self._store(state, event.block_hashes, keys, tier)
        if forgotten:
            await self.index.remove(state.engine, forgotten, tier)
        self.counters.events["BlockStored"] += 1
        self.counters.blocks_stored += nblocks

    async def _stored_by_hash(self, state: StreamState, event: BlockStored) -> None:
        """A tokenless store: each engine hash resolves to the key the stream gave it."""
        if event.block_size and state.block_size and event.block_size != state.block_size:
            # A tokenless store names blocks by hash, so a size it carries must agree.
            self.counters.skipped["block_size_mismatch"] += 1
            return
        if not event.block_hashes:
            self.counters.skipped["malformed"] += 1
            return
        tier = Tier.from_medium(event.medium, event.locality, event.ownership)
        hashes: list[int] = []
        keys: list[int] = []
        for engine_hash in event.block_hashes:
            key = state.key_of(engine_hash)
            if key is not None:
                hashes.append(engine_hash)
                keys.append(key)
        unresolved = len(event.block_hashes) - len(keys)
        if unresolved:
            self.counters.skipped["tokenless_unresolved"] += unresolved
        if not keys:
            return
        forgotten = self._remember(state.hashes[tier], hashes, keys)
        await self._store(state, hashes, keys, tier)
        if forgotten:
            await self.index.remove(state.engine, forgotten, tier)
        self.counters.events["BlockStored"] += 1
        self.counters.blocks_stored += len(keys)
        self.counters.tokenless_blocks += len(keys)

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
        if event.all_tiers:
            await self._removed_everywhere(state, event)
            return
        tier = Tier.from_medium(event.medium, event.locality, event.ownership)
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

    async def _removed_everywhere(self, state: StreamState, event: BlockRemoved) -> None:
        """Blocks gone from every tier that held them."""
        seen: set[int] = set()
        removed = 0
        for tier in Tier:
            table = state.hashes[tier]
            keys = []
            for engine_hash in event.block_hashes:
                key = table.pop(engine_hash, None)
                if key is not None:
                    keys.append(key)
                    seen.add(engine_hash)
            if keys:
                removed += len(keys)
                await self.index.remove(state.engine, keys, tier)
        unknown = len(set(event.block_hashes) - seen)
        if unknown:
            self.counters.skipped["unknown_hash"] += unknown
        self.counters.events["BlockRemoved"] += 1
        self.counters.blocks_removed += removed
