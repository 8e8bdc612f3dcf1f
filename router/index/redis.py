"""The Redis-backed KV-block index, shared by router replicas and the standalone indexer:
the :class:`~router.index.remote.FencedIndex` kvroute ships.

Layout (``docs/redis-schema.md`` has every key and the reasons; ``router/redis/schema.py``
names them): all keys live under the hash tag ``{namespace}``, so a namespace sits in
one Redis Cluster slot and every script may touch all of it. A block's firm holders
(engine id and tier bits, sorted) are one field of the hash ``{ns}:v3:shared`` while it
has two or more (or expiring records), else of the bucketed blocks table; its expiring
holders (engine id and deadline) one field of the hash ``{ns}:v3:records``. Per engine
id and tier (0 GPU, 1 CPU, 2 disk), a bucketed holdings table maps each firmly held
block to the engine's own hash for it: what ``clear`` drops and what a new indexer
reloads to apply removals after taking over.
A bucketed table is many small hashes, each a listpack, found by linear hashing on a
key's top bits (:func:`bucket_key` and ``lua/lib.lua``): that is what keeps a firm
entry under 64 bytes.

Every operation is one Lua script call, so a lookup costs exactly one round trip and
stops walking at the first block no candidate holds. Time comes from the caller's
clock (wall clock by default: replicas compare deadlines written by each other), never
from Redis. Calls go through a :class:`~router.redis.client.RedisClient`, which bounds
each one, tracks Redis's availability and tells the index's ``listeners``; the router
hands the same client (:attr:`RedisIndex.redis`) to what else replicas share through
Redis (``router/redis/``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from router.index.base import IndexStats, Match
from router.index.redis_config import RedisIndexConfig
from router.index.remote import (
    AddOp,
    AvailabilityListener,
    ClearOp,
    ExpireOp,
    FencedIndex,
    LeaseMode,
    RemoveOp,
    StreamPosition,
    WriteBatch,
    WriteOp,
    WriteResult,
)
from router.redis import leases
from router.redis.client import RedisClient, Script
from router.redis.schema import pack_keys, unpack_key
from router.types import EngineKey, Tier

__all__ = ["RedisIndex", "bucket_key", "bucket_name"]

_CANDIDATE_CACHE = 1024

_LOOKUP = Script("lookup.lua")
_WRITE = Script("write.lua")
_STATS = Script("stats.lua")


class _CandidateIds:
    """A candidate list as lookups send it: joined labels, and their engine ids (uint16
    each) as of engine-map epoch ``epoch`` (empty until the script first sends them)."""

    __slots__ = ("epoch", "ids", "labels")

    def __init__(self, labels: str) -> None:
        self.labels = labels
        self.epoch = b""
        self.ids = b""


def bucket_key(table: str | bytes, key: int, level: int, split: int) -> bytes:
    """The name of the hash of bucketed ``table`` (its meta key) holding block ``key``,
    for the table's geometry ``level`` and ``split`` (the meta hash's ``L`` and ``s``):
    linear hashing on the key's top 24 bits, as ``lua/lib.lua`` computes it."""
    h = key >> 40
    b = h % (1 << level)
    if b < split:
        b = h % (2 << level)
    return bucket_name(table, b)


def bucket_name(table: str | bytes, bucket: int) -> bytes:
    """The name of bucket number ``bucket`` of bucketed ``table``."""
    base = table.encode() if isinstance(table, str) else table
    return base + b":" + bytes((bucket & 0xFF, (bucket >> 8) & 0xFF, bucket >> 16))


def _arg_ops(ops: Sequence[WriteOp]) -> list[bytes | str]:
    args: list[bytes | str] = []
    for op in ops:
        if isinstance(op, AddOp):
            hashes = pack_keys(op.hashes) if op.hashes is not None else b""
            args += ["A", str(int(op.tier)), "", pack_keys(op.keys), hashes]
        elif isinstance(op, ExpireOp):
            args += ["E", "", repr(float(op.ttl)), pack_keys(op.keys), ""]
        elif isinstance(op, RemoveOp):
            tier = "*" if op.tier is None else str(int(op.tier))
            args += ["R", tier, "", pack_keys(op.keys), ""]
        else:
            args += ["C", "", "", "", ""]
    return args


class RedisIndex(FencedIndex):
    """A :class:`~router.index.remote.FencedIndex` kept in Redis (or Valkey), read and
    written by Lua scripts.

    The arguments but ``clock`` make its :class:`~router.redis.client.RedisClient`
    (:attr:`redis`), which the index owns and closes: ``budget_ms`` bounds every index
    call; ``admin_timeout`` bounds calls off the request path (stats, leases, write
    pipelines of the indexer, position loading). ``clock`` gives the time deadlines are
    measured on; every process sharing the namespace must use the same one (the default
    wall clock: keep hosts NTP-synced).
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        namespace: str = "kvroute",
        *,
        budget_ms: float = 5.0,
        slow_calls_to_outage: int = 1,
        clock: Callable[[], float] = time.time,
        retry_interval: float = 0.5,
        admin_timeout: float = 5.0,
        client: aioredis.Redis | RedisCluster | None = None,
    ) -> None:
        self.redis = RedisClient(
            url,
            namespace,
            budget_ms=budget_ms,
            slow_calls_to_outage=slow_calls_to_outage,
            retry_interval=retry_interval,
            admin_timeout=admin_timeout,
            client=client,
        )
        """The connection the index runs over: the router's load exchange, decision
        stream and stored responses share it (and its availability)."""
        self.redis.register(_LOOKUP, _WRITE, _STATS, leases.LEASE)
        self.listeners: list[AvailabilityListener] = self.redis.listeners
        """Told of every availability transition (the client's listeners)."""
        self.counters = self.redis.counters
        """What calls did, the load exchange's and the decision stream's included."""
        self._clock = clock
        self._keys = self.redis.keys
        self._candidates: dict[tuple[EngineKey, ...], _CandidateIds] = {}

    @classmethod
    def from_config(cls, config: RedisIndexConfig, **kwargs: Any) -> RedisIndex:
        """The index an ``index.redis`` configuration section describes."""
        return cls(
            config.url,
            config.namespace,
            budget_ms=config.budget_ms,
            slow_calls_to_outage=config.slow_calls_to_outage,
            **kwargs,
        )

    @property
    def available(self) -> bool:
        """False from a failed call until Redis answers the background probe."""
        return self.redis.available

    def describe(self) -> str:
        return self.redis.describe()

    # ------------------------------------------------------------------ KVIndex

    async def lookup(
        self, keys: Sequence[int], candidates: Sequence[EngineKey]
    ) -> Mapping[EngineKey, Match]:
        if not keys or not candidates:
            return {}
        ids = self._candidate_ids(candidates)
        args = [repr(self._clock()), pack_keys(keys), ids.epoch, ids.ids, ids.labels]
        keys_ = self._keys.lookup
        redis = self.redis
        flat = await redis.call(lambda: redis.evalsha(_LOOKUP, keys_, args), redis.budget)
        first = 1
        if flat[0] == 1:  # the engine map changed since these ids were cached
            ids.epoch, ids.ids = flat[1], flat[2]
            first = 3
        return {
            candidates[flat[i] - 1]: Match(flat[i + 1], flat[i + 2], flat[i + 3])
            for i in range(first, len(flat), 4)
        }

    def _candidate_ids(self, candidates: Sequence[EngineKey]) -> _CandidateIds:
        # Routers ask about the same few candidate lists over and over: keep their labels
        # joined (redis-py packs each argument at about a microsecond) and their engine
        # ids, so the script resolves labels only when the engine map has changed.
        key = tuple(candidates)
        ids = self._candidates.get(key)
        if ids is None:
            if len(self._candidates) >= _CANDIDATE_CACHE:
                self._candidates.clear()
            ids = self._candidates[key] = _CandidateIds("\n".join([c.label for c in key]))
        return ids

    async def add(
        self,
        engine: EngineKey,
        keys: Sequence[int],
        tier: Tier = Tier.GPU,
        ttl: float | None = None,
    ) -> None:
        if keys:
            op: WriteOp = AddOp(keys, tier) if ttl is None else ExpireOp(keys, ttl)
            await self._write_one(WriteBatch(engine, [op]), self.redis.budget)

    async def remove(
        self, engine: EngineKey, keys: Sequence[int], tier: Tier | None = None
    ) -> None:
        if keys:
            await self._write_one(WriteBatch(engine, [RemoveOp(keys, tier)]), self.redis.budget)

    async def clear(self, engine: EngineKey) -> None:
        await self._write_one(WriteBatch(engine, [ClearOp()]), self.redis.budget)

    async def stats(self) -> IndexStats:
        redis = self.redis
        args = [repr(self._clock()), self._keys.prefix, 4096]
        while True:
            reply = await redis.call(
                lambda: redis.evalsha(_STATS, self._keys.fixed, args), redis.admin_timeout
            )
            if reply[0] == 0:  # else garbage was left to collect first: call again
                return IndexStats(blocks=reply[1], entries=reply[2], engines=reply[3])

    async def close(self) -> None:
        await self.redis.close()

    # ------------------------------------------------------------------ batched writes

    def _write_args(self, batch: WriteBatch) -> tuple[tuple[str, ...], list[Any]]:
        fence = batch.fence
        if fence is None:
            head: list[Any] = ["", "", ""]
        else:
            seq = "" if fence.seq is None else str(fence.seq)
            head = [fence.token, seq, repr(float(fence.ts))]
        args = [repr(self._clock()), self._keys.prefix, batch.engine.label, *head]
        return self._keys.engine(batch.engine), args + _arg_ops(batch.ops)

    async def _write_one(self, batch: WriteBatch, timeout: float) -> WriteResult:
        keys, args = self._write_args(batch)
        redis = self.redis
        reply = await redis.call(lambda: redis.evalsha(_WRITE, keys, args), timeout)
        return WriteResult(reply)

    async def write(
        self, batches: Sequence[WriteBatch], timeout: float | None = None
    ) -> list[WriteResult]:
        """Apply ``batches`` in order, pipelined in one round trip; each is atomic.

        Raises :class:`~router.index.base.IndexUnavailable` when Redis fails or the
        pipeline takes longer than ``timeout`` (default ``admin_timeout``); some batches
        may have been applied then, which fenced writers learn from the stream position.
        """
        if not batches:
            return []
        redis = self.redis
        calls = [self._write_args(b) for b in batches]
        replies = await redis.call(
            lambda: redis.evalsha_many(_WRITE, calls),
            redis.admin_timeout if timeout is None else timeout,
        )
        return [WriteResult(r) for r in replies]

    # ------------------------------------------------------------------ fencing

    async def lease(
        self,
        engine: EngineKey,
        token: str,
        ttl_ms: int,
        mode: LeaseMode,
        timeout: float | None = None,
    ) -> bool:
        """Acquire (``SET NX PX``, or extend if ``token`` holds it), ``renew`` or
        ``release`` the engine stream's writer lease; True when ``token`` holds it after
        (or released it). ``timeout`` defaults to ``admin_timeout``."""
        key = self._keys.lease(engine)
        return await leases.lease(self.redis, key, token, ttl_ms, mode, timeout)

    async def stream_position(
        self, engine: EngineKey, timeout: float | None = None
    ) -> StreamPosition:
        """The engine stream's last applied batch and its engine-hash -> key maps."""
        client = self.redis.client
        keys = self._keys

        async def run() -> StreamPosition:
            seq, ts = await client.hmget(keys.stream(engine), ["seq", "ts"])
            maps: tuple[dict[int, int], ...] = tuple({} for _ in Tier)
            engine_id = await client.hget(keys.fixed[2], engine.label)
            if engine_id is not None:
                eid = int(engine_id)
                for tier in Tier:
                    await self._read_held(keys.held(eid, tier), maps[tier])
            return StreamPosition(
                int(seq) if seq is not None else None,
                float(ts) if ts is not None else None,
                maps,
            )

        return await self.redis.call(run, self.redis.admin_timeout if timeout is None else timeout)

    async def _read_held(self, table: str, into: dict[int, int]) -> None:
        # Every bucket of one holdings table, 256 buckets a pipeline.
        client = self.redis.client
        level, split = await client.hmget(table, ["L", "s"])
        if level is None:
            return
        buckets = (1 << int(level)) + int(split or 0)
        for first in range(0, buckets, 256):
            pipe = client.pipeline(transaction=False)
            for b in range(first, min(buckets, first + 256)):
                pipe.hgetall(bucket_name(table, b))
            for held in await pipe.execute():
                for block, engine_hash in held.items():
                    if engine_hash:  # entries recorded without an engine hash have none
                        into[unpack_key(engine_hash)] = unpack_key(block)
