"""One bounded, availability-tracking connection to the Redis that replicas share.

Every call goes through :meth:`RedisClient.call` with a time bound: a slower or
unreachable Redis raises :class:`~router.index.base.IndexUnavailable`, after which calls
fail at once until a background probe finds Redis answering again. ``listeners`` hear
of both transitions; on the way back they learn whether Redis may have lost the
namespace's data in between (a marker key, the *incarnation*, is gone or changed), so
that routers know what to reconcile. The index (``router/index/redis.py``) and the
replicas' other shared state (the rest of this package) run over one client, so one
outage is noticed, counted and probed once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from importlib import resources
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError, ResponseError

from router.availability import AvailabilityListener, IndexUnavailable, RemoteCounters
from router.redaction import redacted
from router.redis.schema import Keys

if TYPE_CHECKING:
    from router.index.redis_config import RedisIndexConfig

# The name operators' log filters know from when the index held the connection.
log = logging.getLogger("kvroute.index.redis")

T = TypeVar("T")

if sys.version_info >= (3, 11):

    async def _within(aw: Awaitable[T], timeout: float) -> T:
        # asyncio.timeout cancels in place; wait_for (3.10) wraps the call in a new task,
        # which costs tens of microseconds on the lookup path.
        async with asyncio.timeout(timeout):
            return await aw

else:

    async def _within(aw: Awaitable[T], timeout: float) -> T:
        return await asyncio.wait_for(aw, timeout)


def replica_id() -> str:
    """A name for this router process, unique among replicas (host, pid, random)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class Script:
    """A Lua script from ``router/index/lua`` with the shared helpers prepended."""

    def __init__(self, name: str) -> None:
        lua = resources.files("router.index").joinpath("lua")
        self.source = lua.joinpath("lib.lua").read_text() + "\n" + lua.joinpath(name).read_text()
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()


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


class RedisClient:
    """A namespace in Redis (or Valkey) and the bounded calls made to it.

    ``budget_ms`` bounds request-path calls (index lookups and records);
    ``admin_timeout`` is the default bound of calls off the request path. After
    ``slow_calls_to_outage`` calls in a row over their bound, or at once when Redis
    cannot be reached, Redis counts as unavailable until the probe, every
    ``retry_interval`` seconds, finds it answering.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        namespace: str = "kvroute",
        *,
        budget_ms: float = 5.0,
        slow_calls_to_outage: int = 1,
        retry_interval: float = 0.5,
        admin_timeout: float = 5.0,
        client: aioredis.Redis | RedisCluster | None = None,
    ) -> None:
        self.url = url
        self.namespace = namespace
        self.keys = Keys(namespace)
        """The namespace's key names."""
        self.budget = budget_ms / 1000.0
        self.slow_calls_to_outage = slow_calls_to_outage
        self._slow_in_a_row = 0
        self.retry_interval = retry_interval
        self.admin_timeout = admin_timeout
        self.counters = RemoteCounters()
        """What calls did, for metrics (the index reports them as its own)."""
        self._client = client if client is not None else client_from_url(url)
        self._slot_owner: aioredis.Redis | None = None
        self._up = True
        self._probe: asyncio.Task[None] | None = None
        self._incarnation: str | None = None
        self._scripts: dict[str, Script] = {}
        self.outage_note = "routing on load and this process's recent decisions until it answers"
        """What routing does while Redis is away, for the outage's log line."""
        self.listeners: list[AvailabilityListener] = []
        """Told of every availability transition (see :data:`AvailabilityListener`)."""

    @classmethod
    def from_config(cls, config: RedisIndexConfig, **kwargs: Any) -> RedisClient:
        """The client an ``index.redis`` configuration section describes."""
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

    @property
    def client(self) -> aioredis.Redis | RedisCluster:
        """The underlying redis-py client (for the modules of this package, tools and
        tests)."""
        return self._client

    def key(self, name: str) -> str:
        """The full Redis name of the layout's key ``name`` (``blocks``,
        ``lease:<engine>``, ``decisions``, ...), prefix included: for operators and
        tests."""
        return self.keys.prefix + name

    def describe(self) -> str:
        """Where the namespace lives, for log lines (never with credentials)."""
        return f"{redacted(self.url)} namespace {self.namespace}"

    # ------------------------------------------------------------------ calls

    async def call(
        self, fn: Callable[[], Awaitable[T]], timeout: float, reset_slow: bool = True
    ) -> T:
        """``fn()`` within ``timeout`` seconds, or :class:`IndexUnavailable` (at once
        while Redis is known to be away). An error answer is no outage; a late one is
        after ``slow_calls_to_outage`` in a row, unless a call that answered in time
        (with ``reset_slow``) came between. A blocking read passes ``reset_slow=False``:
        its answer says nothing of whether Redis answers quickly."""
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

    # ------------------------------------------------------------------ incarnation

    async def check_incarnation(self, timeout: float | None = None) -> bool:
        """Learn the namespace's incarnation marker (creating it if missing); True when
        it is not the one this process saw last, or none was seen: data written before
        may be gone. Routers call it at start; the probe calls it after every outage.
        ``timeout`` defaults to ``admin_timeout``."""
        return await self.call(
            self._swap_incarnation, self.admin_timeout if timeout is None else timeout
        )

    async def _swap_incarnation(self) -> bool:
        # SET NX GET: the first process to find the marker missing (a Redis that
        # restarted empty, or a fresh namespace) starts a new incarnation; the others
        # then read it and see that it changed.
        mine = secrets.token_hex(8)
        old = await self._client.set(self.keys.incarnation, mine, nx=True, get=True)
        current = mine if old is None else (old.decode() if isinstance(old, bytes) else old)
        changed = current != self._incarnation
        self._incarnation = current
        return changed

    # ------------------------------------------------------------------ scripts

    def register(self, *scripts: Script) -> None:
        """Scripts this client's users run: all are loaded again when Redis answers that
        it does not know one (it restarted, or its script cache was flushed)."""
        for script in scripts:
            self._scripts[script.sha] = script

    async def evalsha(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """One call of ``script`` (unbounded: run it inside :meth:`call`)."""
        try:
            return await self._client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            self.register(script)
            await self._load_scripts()
            return await self._client.evalsha(script.sha, len(keys), *keys, *args)

    async def evalsha_many(
        self, script: Script, calls: Sequence[tuple[Sequence[str], Sequence[Any]]]
    ) -> list[Any]:
        """``script`` once per (keys, args) of ``calls``, pipelined in one round trip
        (unbounded: run it inside :meth:`call`); the replies in order. Raises the first
        error reply (those before it were applied)."""
        replies = await self._pipeline(script, calls)
        if any(isinstance(r, NoScriptError) for r in replies):
            self.register(script)
            await self._load_scripts()
            # A NOSCRIPT reply means the call did not run: retry exactly those, in order.
            missed = [isinstance(r, NoScriptError) for r in replies]
            retry = [c for c, m in zip(calls, missed, strict=True) if m]
            again = iter(await self._pipeline(script, retry))
            replies = [next(again) if m else r for r, m in zip(replies, missed, strict=True)]
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    async def _load_scripts(self) -> None:
        for script in self._scripts.values():
            await self._client.script_load(script.source)

    async def _pipeline(
        self, script: Script, calls: Sequence[tuple[Sequence[str], Sequence[Any]]]
    ) -> list[Any]:
        client = self._client
        if isinstance(client, RedisCluster):
            client = await self._namespace_node()
        pipe = client.pipeline(transaction=False)
        for keys, args in calls:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
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
            node = cluster.get_node_from_key(self.keys.fixed[0])
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

    async def close(self) -> None:
        """Stop probing and close the connections."""
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
        await self._forget_namespace_node()
        await self._client.aclose()
