"""The Redis-backed KV-block index, shared by router replicas and the standalone indexer:
the :class:`~router.index.remote.FencedIndex` kvroute ships.

Layout (``docs/redis-schema.md`` has every key and the reasons): all keys live under
the hash tag ``{namespace}``, so a namespace sits in one Redis Cluster slot and every
script may touch all of it. A block's firm holders (engine id and tier bits, sorted)
are one field of the hash ``{ns}:v3:shared`` while it has two or more (or expiring
records), else of the bucketed blocks table; its expiring holders (engine id and
deadline) one field of the hash ``{ns}:v3:records``. Per engine id and tier (0 GPU,
1 CPU, 2 disk), a bucketed holdings table maps each firmly held block to the engine's
own hash for it: what ``clear`` drops and what a new indexer reloads to apply removals
after taking over.
A bucketed table is many small hashes, each a listpack, found by linear hashing on a
key's top bits (:func:`bucket_key` and ``lua/lib.lua``): that is what keeps a firm
entry under 64 bytes.

Every operation is one Lua script call, so a lookup costs exactly one round trip and
stops walking at the first block no candidate holds. Time comes from the caller's
clock (wall clock by default: replicas compare deadlines written by each other), never
from Redis. Every call is bounded by the budget: a slower or unreachable Redis raises
:class:`IndexUnavailable`, after which calls fail at once until a background probe
finds Redis answering again. ``listeners`` hear of both transitions; on the way back
they learn whether Redis may have lost the namespace's data in between (a marker key,
the *incarnation*, is gone or changed), so that routers know what to reconcile.

Router replicas also exchange their in-flight load per engine here
(:meth:`RedisIndex.share_load`): one script call that writes this replica's entry and
returns the others'.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
import socket
import sys
import time
from array import array
from collections.abc import Awaitable, Callable, Mapping, Sequence
from importlib import resources
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError, ResponseError

from router.config import RedisIndexConfig
from router.index.base import IndexStats, IndexUnavailable, Match
from router.index.remote import (
    AddOp,
    AvailabilityListener,
    ClearOp,
    ExpireOp,
    Fence,
    FencedIndex,
    LeaseMode,
    RemoteCounters,
    RemoveOp,
    StreamPosition,
    WriteBatch,
    WriteOp,
    WriteResult,
)
from router.types import EngineKey, Tier

# The write vocabulary lived here before it was shared by remote backends: still
# importable from this module.
__all__ = [
    "MAX_CONNECTIONS",
    "AddOp",
    "AvailabilityListener",
    "ClearOp",
    "ExpireOp",
    "Fence",
    "RedisIndex",
    "RedisIndexCounters",
    "RemoveOp",
    "StreamPosition",
    "WriteBatch",
    "WriteOp",
    "WriteResult",
    "client_from_url",
    "pack_keys",
    "unpack_key",
]

log = logging.getLogger("kvroute.index.redis")

T = TypeVar("T")

_NATIVE_LE = sys.byteorder == "little"
_CANDIDATE_CACHE = 1024

if sys.version_info >= (3, 11):

    async def _within(aw: Awaitable[T], timeout: float) -> T:
        # asyncio.timeout cancels in place; wait_for (3.10) wraps the call in a new task,
        # which costs tens of microseconds on the lookup path.
        async with asyncio.timeout(timeout):
            return await aw

else:

    async def _within(aw: Awaitable[T], timeout: float) -> T:
        return await asyncio.wait_for(aw, timeout)


def _text(raw: bytes | str) -> str:
    """A Redis reply as text (invalid UTF-8 replaced: names read back are only compared
    and logged)."""
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


def replica_id() -> str:
    """A name for this router process, unique among replicas (host, pid, random)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def pack_keys(keys: Sequence[int]) -> bytes:
    """Block keys (or engine hashes) as back-to-back 8-byte little-endian strings."""
    packed = array("Q", keys)
    if not _NATIVE_LE:
        packed.byteswap()
    return packed.tobytes()


def unpack_key(raw: bytes) -> int:
    """One 8-byte little-endian key as stored in Redis."""
    return int.from_bytes(raw, "little")


# --------------------------------------------------------------------------- scripts


class _Script:
    """A Lua script from ``router/index/lua`` with the shared helpers prepended."""

    def __init__(self, name: str) -> None:
        lua = resources.files("router.index").joinpath("lua")
        self.source = lua.joinpath("lib.lua").read_text() + "\n" + lua.joinpath(name).read_text()
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()


_LOOKUP = _Script("lookup.lua")
_WRITE = _Script("write.lua")
_STATS = _Script("stats.lua")
_LEASE = _Script("lease.lua")
_LOAD = _Script("load.lua")
_SCRIPTS = (_LOOKUP, _WRITE, _STATS, _LEASE, _LOAD)

#: The name this module gave the counters before they were shared by remote backends.
RedisIndexCounters = RemoteCounters


# --------------------------------------------------------------------------- the index


class _CandidateIds:
    """A candidate list as lookups send it: joined labels, and their engine ids (uint16
    each) as of engine-map epoch ``epoch`` (empty until the script first sends them)."""

    __slots__ = ("epoch", "ids", "labels")

    def __init__(self, labels: str) -> None:
        self.labels = labels
        self.epoch = b""
        self.ids = b""


LAYOUT = 3
"""The layout of the index's keys and values (docs/redis-schema.md): 3 since tables
keyed by block key are bucketed; 2 gave the disk tier a third tier bit (``engine id x 8
+ tier bits``). It is part of every index key's name (``{ns}:v3:blocks``), so a router
of another layout never reads keys it would misread: it builds its own from replay and
events, and routers of both layouts can share a namespace during a rolling upgrade."""


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


class _Keys:
    """Key names under the namespace's hash tag: the index's under the layout's prefix,
    the load exchange, the incarnation marker and stored responses beside it (their
    values do not depend on the index's layout)."""

    def __init__(self, namespace: str) -> None:
        if "{" in namespace or "}" in namespace:
            raise ValueError(f"Redis namespace {namespace!r} must not contain braces")
        self.tag = f"{{{namespace}}}:"
        self.prefix = f"{self.tag}v{LAYOUT}:"
        p = self.prefix
        self.fixed = (
            f"{p}blocks",
            f"{p}expiring-adds",
            f"{p}engines",
            f"{p}engine-free",
            f"{p}engine-next",
            f"{p}gc",
            f"{p}engine-epoch",
            f"{p}records",
            f"{p}shared",
        )
        f = self.fixed
        self.lookup = (f[0], f[2], f[6], f[7], f[8])
        self.incarnation = f"{self.tag}incarnation"
        self.load = f"{self.tag}load"
        # Replicated mode (router.index.replicated): the decision stream, the engines'
        # stream snapshots and the lease of the replica that writes them.
        self.decisions = f"{p}decisions"
        self.snapshots = f"{p}snapshots"
        self.snapshots_seen = f"{p}snapshots-seen"
        self.snapshot_lease = f"{p}snapshot-lease"
        self._engine: dict[EngineKey, tuple[str, ...]] = {}

    def held(self, engine_id: int, tier: Tier) -> str:
        """The meta key of an engine id's holdings table of ``tier``."""
        return f"{self.prefix}held:{engine_id}:{int(tier)}"

    def response(self, response_id: str) -> str:
        """The key naming the engine that holds a stored Responses API response."""
        return f"{self.tag}response:{response_id}"

    def engine(self, engine: EngineKey) -> tuple[str, ...]:
        """Fixed keys plus the engine's own, as write.lua takes them (its holdings
        tables are named by its engine id, inside the script)."""
        keys = self._engine.get(engine)
        if keys is None:
            p, label = self.prefix, engine.label
            keys = (
                *self.fixed,
                f"{p}expiring:{label}",
                f"{p}expiring-n:{label}",
                f"{p}stream:{label}",
                f"{p}lease:{label}",
            )
            self._engine[engine] = keys
        return keys


#: Connections one client keeps to a Redis node; more concurrent calls wait for one.
MAX_CONNECTIONS = 100


def client_from_url(
    url: str, node: tuple[str, int] | None = None, **kwargs: Any
) -> aioredis.Redis | RedisCluster:
    """An asyncio client for ``url``; ``?cluster=true`` selects the Redis Cluster client,
    unless ``node`` (host, port) asks for a plain client to that cluster node.

    TLS (``rediss://``) and its parameters (``ssl_ca_certs``, ``ssl_certfile``, ...) pass
    through the URL to redis-py. The client never retries on its own: callers bound
    every call and decide what a failure means.
    """
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    cluster = any(k == "cluster" and v.lower() in ("1", "true", "yes") for k, v in query)
    parts = parts._replace(query=urlencode([(k, v) for k, v in query if k != "cluster"]))
    if node is not None:
        cluster = False
        auth = parts.netloc.rpartition("@")[0]
        host = f"[{node[0]}]" if ":" in node[0] else node[0]
        parts = parts._replace(netloc=f"{auth}@{host}:{node[1]}" if auth else f"{host}:{node[1]}")
    rest = urlunsplit(parts)
    kwargs.setdefault("socket_connect_timeout", 2.0)
    # Callers bound whole calls; a socket timeout would add a task per send.
    kwargs.setdefault("socket_timeout", None)
    kwargs.setdefault("socket_keepalive", True)
    if cluster:
        return RedisCluster.from_url(rest, **kwargs)
    # A pool that waits for a free connection instead of failing with "Too many
    # connections" (which would read as an outage): callers' bounds cut the wait short.
    kwargs.setdefault("max_connections", MAX_CONNECTIONS)
    pool = aioredis.BlockingConnectionPool.from_url(
        rest, timeout=None, retry=Retry(NoBackoff(), 0), **kwargs
    )
    return aioredis.Redis.from_pool(pool)  # closing the client closes the pool


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

    ``clock`` gives the time deadlines are measured on; every process sharing the
    namespace must use the same one (the default wall clock: keep hosts NTP-synced).
    ``budget_ms`` bounds every index call; ``admin_timeout`` bounds calls off the
    request path (stats, leases, write pipelines of the indexer, position loading).
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
        self.url = url
        self.namespace = namespace
        self.budget = budget_ms / 1000.0
        self.slow_calls_to_outage = slow_calls_to_outage
        self._slow_in_a_row = 0
        self.retry_interval = retry_interval
        self.admin_timeout = admin_timeout
        self.counters = RemoteCounters()
        self._clock = clock
        self._keys = _Keys(namespace)
        self._client = client if client is not None else client_from_url(url)
        self._slot_owner: aioredis.Redis | None = None
        self._up = True
        self._probe: asyncio.Task[None] | None = None
        self._candidates: dict[tuple[EngineKey, ...], _CandidateIds] = {}
        self._incarnation: str | None = None
        self.outage_note = "routing on load and this process's recent decisions until it answers"
        """What routing does while Redis is away, for the outage's log line."""
        self.listeners: list[AvailabilityListener] = []
        """Told of every availability transition (see :data:`AvailabilityListener`)."""

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
        return self._up

    def key(self, name: str) -> str:
        """The full Redis name of the index key ``name`` (``blocks``,
        ``lease:<engine>``, ...), layout prefix included: for operators and tests."""
        return self._keys.prefix + name

    def describe(self) -> str:
        from router.security import redacted

        return f"{redacted(self.url)} namespace {self.namespace}"

    @property
    def client(self) -> aioredis.Redis | RedisCluster:
        """The underlying redis-py client (for tools and tests; not for index data)."""
        return self._client

    # ------------------------------------------------------------------ calls

    async def _call(
        self, fn: Callable[[], Awaitable[T]], timeout: float, reset_slow: bool = True
    ) -> T:
        if not self._up:
            self.counters.fast_failures += 1
            raise IndexUnavailable("Redis is unreachable; routing without the index", "unreachable")
        self.counters.calls += 1
        try:
            answer = await _within(fn(), timeout)
        except asyncio.TimeoutError as exc:
            self._slow_in_a_row += 1
            if self._slow_in_a_row >= self.slow_calls_to_outage:
                self._lost(f"{self._slow_in_a_row} calls in a row over {timeout * 1000:.1f} ms")
            else:
                self.counters.failures += 1
                self.counters.slow_calls += 1
            raise IndexUnavailable(
                f"Redis did not answer within {timeout * 1000:.1f} ms", "over_budget"
            ) from exc
        except ResponseError as exc:  # Redis answered: an error, not an outage
            self.counters.failures += 1
            raise IndexUnavailable(f"Redis refused the call: {exc}", "refused") from exc
        except (RedisError, OSError) as exc:
            self._lost(str(exc) or type(exc).__name__)
            raise IndexUnavailable(f"Redis is unreachable: {exc}", "unreachable") from exc
        if reset_slow:
            self._slow_in_a_row = 0
        return answer

    def _lost(self, reason: str) -> None:
        self.counters.failures += 1
        self._slow_in_a_row = 0
        if not self._up:
            return
        self._up = False
        self.counters.outages += 1
        log.warning("Redis index unavailable (%s); %s", reason, self.outage_note)
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._probe_until_up())
        self._tell(False, False)

    def _tell(self, available: bool, data_lost: bool) -> None:
        for listener in list(self.listeners):
            try:
                listener(available, data_lost)
            except Exception:  # a listener's bug must not keep the index down
                log.exception("Redis availability listener failed")

    async def _probe_until_up(self) -> None:
        # A generous timeout: the probe asks whether Redis is alive, not whether it is fast.
        timeout = max(self.budget, 0.25)
        while True:
            await asyncio.sleep(self.retry_interval)
            try:
                await self._drop_idle_connections()
                await _within(self._client.ping(), timeout)
                data_lost = await _within(self._swap_incarnation(), timeout)
            except (asyncio.TimeoutError, RedisError, OSError):
                continue
            self._up = True
            log.warning(
                "Redis index reachable again%s",
                " (it lost its data meanwhile)" if data_lost else "",
            )
            self._tell(True, data_lost)
            return

    async def _drop_idle_connections(self) -> None:
        # Connections made before a restart are dead, and each would fail once before
        # the client replaced it: the probe (and the first calls after it) would need
        # as many rounds as the pool has connections. Idle ones reconnect on next use.
        if isinstance(self._client, RedisCluster):
            for node in self._client.get_nodes():
                await node.disconnect()
        else:
            await self._client.connection_pool.disconnect(inuse_connections=False)

    async def check_incarnation(self, timeout: float | None = None) -> bool:
        """Learn the namespace's incarnation marker (creating it if missing); True when
        it is not the one this process saw last, or none was seen: data written before
        may be gone. Routers call it at start; the probe calls it after every outage.
        ``timeout`` defaults to ``admin_timeout``."""
        return await self._call(
            self._swap_incarnation, self.admin_timeout if timeout is None else timeout
        )

    async def _swap_incarnation(self) -> bool:
        # SET NX GET: the first process to find the marker missing (a Redis that
        # restarted empty, or a fresh namespace) starts a new incarnation; the others
        # then read it and see that it changed.
        mine = secrets.token_hex(8)
        old = await self._client.set(self._keys.incarnation, mine, nx=True, get=True)
        current = mine if old is None else (old.decode() if isinstance(old, bytes) else old)
        changed = current != self._incarnation
        self._incarnation = current
        return changed

    async def _evalsha(self, script: _Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return await self._client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self._load_scripts()  # Redis restarted or its script cache was flushed
            return await self._client.evalsha(script.sha, len(keys), *keys, *args)

    async def _load_scripts(self) -> None:
        for script in _SCRIPTS:
            await self._client.script_load(script.source)

    # ------------------------------------------------------------------ KVIndex

    async def lookup(
        self, keys: Sequence[int], candidates: Sequence[EngineKey]
    ) -> Mapping[EngineKey, Match]:
        if not keys or not candidates:
            return {}
        ids = self._candidate_ids(candidates)
        args = [repr(self._clock()), pack_keys(keys), ids.epoch, ids.ids, ids.labels]
        keys_ = self._keys.lookup
        flat = await self._call(lambda: self._evalsha(_LOOKUP, keys_, args), self.budget)
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
            await self._write_one(WriteBatch(engine, [op]), self.budget)

    async def remove(
        self, engine: EngineKey, keys: Sequence[int], tier: Tier | None = None
    ) -> None:
        if keys:
            await self._write_one(WriteBatch(engine, [RemoveOp(keys, tier)]), self.budget)

    async def clear(self, engine: EngineKey) -> None:
        await self._write_one(WriteBatch(engine, [ClearOp()]), self.budget)

    async def stats(self) -> IndexStats:
        args = [repr(self._clock()), self._keys.prefix, 4096]
        while True:
            reply = await self._call(
                lambda: self._evalsha(_STATS, self._keys.fixed, args), self.admin_timeout
            )
            if reply[0] == 0:  # else garbage was left to collect first: call again
                return IndexStats(blocks=reply[1], entries=reply[2], engines=reply[3])

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
        await self._forget_namespace_node()
        await self._client.aclose()

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
        reply = await self._call(lambda: self._evalsha(_WRITE, keys, args), timeout)
        return WriteResult(reply)

    async def write(
        self, batches: Sequence[WriteBatch], timeout: float | None = None
    ) -> list[WriteResult]:
        """Apply ``batches`` in order, pipelined in one round trip; each is atomic.

        Raises :class:`IndexUnavailable` when Redis fails or the pipeline takes longer
        than ``timeout`` (default ``admin_timeout``); some batches may have been applied
        then, which fenced writers learn from the stream position.
        """
        if not batches:
            return []
        calls = [self._write_args(b) for b in batches]

        async def run() -> list[WriteResult]:
            replies = await self._pipeline(calls)
            if any(isinstance(r, NoScriptError) for r in replies):
                await self._load_scripts()
                # A NOSCRIPT reply means the call did not run: retry exactly those, in order.
                missed = [isinstance(r, NoScriptError) for r in replies]
                retry = [c for c, m in zip(calls, missed, strict=True) if m]
                again = iter(await self._pipeline(retry))
                replies = [next(again) if m else r for r, m in zip(replies, missed, strict=True)]
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            return [WriteResult(r) for r in replies]

        return await self._call(run, self.admin_timeout if timeout is None else timeout)

    async def _pipeline(self, calls: Sequence[tuple[Sequence[str], Sequence[Any]]]) -> list[Any]:
        client = self._client
        if isinstance(client, RedisCluster):
            client = await self._namespace_node()
        pipe = client.pipeline(transaction=False)
        for keys, args in calls:
            pipe.evalsha(_WRITE.sha, len(keys), *keys, *args)
        try:
            return await pipe.execute(raise_on_error=False)
        except BaseException:
            if client is not self._client:
                await self._forget_namespace_node()
            raise

    async def _namespace_node(self) -> aioredis.Redis:
        # redis-py refuses scripts in cluster pipelines. The namespace lives in one slot,
        # so a plain pipeline to the node serving it is equivalent; after a failure (the
        # slot moved, the node died) the node is looked up again.
        if self._slot_owner is None:
            cluster = self._client
            assert isinstance(cluster, RedisCluster)
            await cluster.initialize()
            node = cluster.get_node_from_key(self._keys.fixed[0])
            if node is None:
                raise ConnectionError("no cluster node serves the namespace's slot")
            owner = client_from_url(self.url, (node.host, node.port))
            assert isinstance(owner, aioredis.Redis)
            self._slot_owner = owner
        return self._slot_owner

    async def _forget_namespace_node(self) -> None:
        if self._slot_owner is not None:
            owner, self._slot_owner = self._slot_owner, None
            await owner.aclose()

    async def _read_held(self, table: str, into: dict[int, int]) -> None:
        # Every bucket of one holdings table, 256 buckets a pipeline.
        level, split = await self._client.hmget(table, ["L", "s"])
        if level is None:
            return
        buckets = (1 << int(level)) + int(split or 0)
        for first in range(0, buckets, 256):
            pipe = self._client.pipeline(transaction=False)
            for b in range(first, min(buckets, first + 256)):
                pipe.hgetall(bucket_name(table, b))
            for held in await pipe.execute():
                for block, engine_hash in held.items():
                    if engine_hash:  # entries recorded without an engine hash have none
                        into[unpack_key(engine_hash)] = unpack_key(block)

    # ------------------------------------------------------------------ shared load

    async def share_load(
        self, replica: str, payload: bytes | None, ttl_ms: int, timeout: float | None = None
    ) -> dict[str, bytes]:
        """Publish this replica's load ``payload`` for ``ttl_ms`` (None: withdraw it) and
        return the other live replicas' payloads by replica id, in one script call.
        ``timeout`` defaults to ``admin_timeout``."""
        args = [replica, b"" if payload is None else payload, int(ttl_ms)]
        flat = await self._call(
            lambda: self._evalsha(_LOAD, [self._keys.load], args),
            self.admin_timeout if timeout is None else timeout,
        )
        return {
            (k.decode() if isinstance(k, bytes) else k): v
            for k, v in zip(flat[::2], flat[1::2], strict=True)
        }

    # ------------------------------------------------------------------ replicated mode

    async def publish_decisions(
        self,
        replica: str,
        payload: bytes,
        min_id: str | None,
        timeout: float | None = None,
        sessions: bytes | None = None,
        load: bytes | None = None,
    ) -> str:
        """Append one entry (``r`` the replica, ``d`` its decisions, ``s`` its session
        pins and ``l`` its load changes when it has some) to the decision stream,
        trimming entries older than ``min_id`` (approximately: whole stream nodes);
        returns the entry's id. ``timeout`` defaults to ``admin_timeout``. Readers that
        know no ``s`` or ``l`` field read the decisions alone."""
        fields = {"r": replica, "d": payload}
        if sessions is not None:
            fields["s"] = sessions
        if load is not None:
            fields["l"] = load
        entry = await self._call(
            lambda: self._client.xadd(
                self._keys.decisions,
                fields,  # type: ignore[arg-type]
                minid=min_id,
                approximate=True,
            ),
            self.admin_timeout if timeout is None else timeout,
            # Held to a looser time than the budget: its answer says nothing of whether
            # lookups are answered within it.
            reset_slow=False,
        )
        return entry.decode() if isinstance(entry, bytes) else str(entry)

    async def read_decisions(
        self, after: str, count: int, block_ms: int | None
    ) -> list[tuple[str, bytes, bytes, bytes, bytes]]:
        """Entries of the decision stream after id ``after``, oldest first, as (id,
        replica (bytes, as stored), payload, session pins, load changes; the last two
        empty when none); with
        ``block_ms``, waits that long for one to arrive. Bounded by the wait plus
        ``admin_timeout``; a blocking read's answer does not reset the count of slow
        calls (:attr:`slow_calls_to_outage`)."""
        wait = (block_ms or 0) / 1000.0
        reply = await self._call(
            lambda: self._client.xread({self._keys.decisions: after}, count=count, block=block_ms),
            wait + self.admin_timeout,
            reset_slow=not block_ms,
        )
        entries: list[tuple[str, bytes, bytes, bytes, bytes]] = []
        for _, items in reply or ():
            for entry_id, fields in items:
                entries.append(
                    (
                        entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
                        fields.get(b"r", b""),
                        fields.get(b"d", b""),
                        fields.get(b"s", b""),
                        fields.get(b"l", b""),
                    )
                )
        return entries

    async def claim_snapshots(
        self, token: str, ttl_ms: int, release: bool = False, timeout: float | None = None
    ) -> bool:
        """Acquire or extend (``release``: give up) the lease of the replica that writes
        the engines' stream snapshots; True when ``token`` holds it (or released it)."""
        mode = "release" if release else "acquire"
        reply = await self._call(
            lambda: self._evalsha(_LEASE, [self._keys.snapshot_lease], [token, ttl_ms, mode]),
            self.admin_timeout if timeout is None else timeout,
        )
        return reply == 1

    async def save_snapshot(
        self, label: str, snapshot: bytes, timeout: float | None = None
    ) -> None:
        """Store one engine stream's snapshot (one call per engine: a fleet's snapshots
        in one command would hold Redis for as long as copying them takes)."""
        await self._call(
            lambda: self._client.hset(self._keys.snapshots, label, snapshot),
            self.admin_timeout if timeout is None else timeout,
        )

    async def mark_snapshots_seen(
        self, labels: Sequence[str], now_ms: int, timeout: float | None = None
    ) -> None:
        """Note that the engines ``labels`` are followed now (their snapshots stay)."""
        if labels:
            await self._call(
                lambda: self._client.hset(
                    self._keys.snapshots_seen, mapping=dict.fromkeys(labels, now_ms)
                ),
                self.admin_timeout if timeout is None else timeout,
            )

    async def drop_stale_snapshots(self, before_ms: int, timeout: float | None = None) -> list[str]:
        """Delete the snapshots of engines no replica has followed since ``before_ms``
        (wall clock); returns their labels."""
        timeout = self.admin_timeout if timeout is None else timeout
        # Stored first, marks second: a snapshot stored in between has its mark already
        # (writers mark before they store), so it is never taken for an unmarked one.
        stored = await self.load_snapshot_labels(timeout)
        seen = await self._call(lambda: self._client.hgetall(self._keys.snapshots_seen), timeout)
        marks = {_text(label): _text(at) for label, at in seen.items()}
        stale = {label for label, at in marks.items() if not at.isdigit() or int(at) < before_ms}
        stale |= {label for label in stored if label not in marks}
        if stale:
            gone = sorted(stale)

            async def run() -> None:
                pipe = self._client.pipeline(transaction=False)
                pipe.hdel(self._keys.snapshots, *gone)
                pipe.hdel(self._keys.snapshots_seen, *gone)
                await pipe.execute()

            await self._call(run, timeout)
        return sorted(stale)

    async def load_snapshot(self, label: str, timeout: float | None = None) -> bytes | None:
        """One engine stream's stored snapshot (None: none)."""
        raw = await self._call(
            lambda: self._client.hget(self._keys.snapshots, label),
            self.admin_timeout if timeout is None else timeout,
        )
        return None if raw is None else bytes(raw)

    async def load_snapshot_labels(self, timeout: float | None = None) -> list[str]:
        """The engine labels stored snapshots are kept under."""
        raw = await self._call(
            lambda: self._client.hkeys(self._keys.snapshots),
            self.admin_timeout if timeout is None else timeout,
        )
        return [_text(k) for k in raw]

    # ------------------------------------------------------------------ stored responses

    async def remember_response(
        self, response_id: str, endpoint: str, ttl_ms: int, timeout: float | None = None
    ) -> None:
        """Record that the engine at ``endpoint`` holds ``response_id``, for ``ttl_ms``
        (one ``SET PX``). ``timeout`` defaults to ``admin_timeout``."""
        key = self._keys.response(response_id)
        await self._call(
            lambda: self._client.set(key, endpoint, px=int(ttl_ms)),
            self.admin_timeout if timeout is None else timeout,
        )

    async def response_engine(self, response_id: str, timeout: float | None = None) -> str | None:
        """The endpoint of the engine holding ``response_id``, None when no replica
        recorded it (or it expired). ``timeout`` defaults to the budget."""
        key = self._keys.response(response_id)
        raw = await self._call(
            lambda: self._client.get(key), self.budget if timeout is None else timeout
        )
        if raw is None:
            return None
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    # ------------------------------------------------------------------ leases and positions

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
        if mode not in ("acquire", "renew", "release"):
            raise ValueError(f"unknown lease mode {mode!r}")
        key = self._keys.engine(engine)[12]
        reply = await self._call(
            lambda: self._evalsha(_LEASE, [key], [token, int(ttl_ms), mode]),
            self.admin_timeout if timeout is None else timeout,
        )
        return reply == 1

    async def stream_position(
        self, engine: EngineKey, timeout: float | None = None
    ) -> StreamPosition:
        """The engine stream's last applied batch and its engine-hash -> key maps."""
        keys = self._keys.engine(engine)

        async def run() -> StreamPosition:
            seq, ts = await self._client.hmget(keys[11], ["seq", "ts"])
            maps: tuple[dict[int, int], ...] = tuple({} for _ in Tier)
            engine_id = await self._client.hget(keys[2], engine.label)
            if engine_id is not None:
                eid = int(engine_id)
                for tier in Tier:
                    await self._read_held(self._keys.held(eid, tier), maps[tier])
            return StreamPosition(
                int(seq) if seq is not None else None,
                float(ts) if ts is not None else None,
                maps,
            )

        return await self._call(run, self.admin_timeout if timeout is None else timeout)
