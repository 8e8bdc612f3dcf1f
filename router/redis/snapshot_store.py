"""The engines' event-stream snapshots in Redis, for the replicated mode's warm start:
``{ns}:v3:snapshots`` (engine label -> snapshot), ``{ns}:v3:snapshots-seen`` (engine
label -> when a writer last followed it) and the writer's lease
(``{ns}:v3:snapshot-lease``).

What a snapshot holds, who writes it when and how a starting replica uses it is
:mod:`router.events.snapshots`'s; this module only stores, lists and drops them.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.redis.client import RedisClient
from router.redis.leases import LEASE, lease


def _text(raw: bytes | str) -> str:
    """A Redis reply as text (invalid UTF-8 replaced: names read back are only compared
    and logged)."""
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


class SnapshotStore:
    """Stored engine stream snapshots and the lease of the replica that writes them.
    Every ``timeout`` defaults to the client's ``admin_timeout``."""

    def __init__(self, redis: RedisClient) -> None:
        self.redis = redis
        redis.register(LEASE)

    async def claim(
        self, token: str, ttl_ms: int, release: bool = False, timeout: float | None = None
    ) -> bool:
        """Acquire or extend (``release``: give up) the lease of the replica that writes
        the engines' stream snapshots; True when ``token`` holds it (or released it)."""
        mode = "release" if release else "acquire"
        return await lease(self.redis, self.redis.keys.snapshot_lease, token, ttl_ms, mode, timeout)

    async def save(self, label: str, snapshot: bytes, timeout: float | None = None) -> None:
        """Store one engine stream's snapshot (one call per engine: a fleet's snapshots
        in one command would hold Redis for as long as copying them takes)."""
        redis = self.redis
        await redis.call(
            lambda: redis.client.hset(redis.keys.snapshots, label, snapshot),
            redis.admin_timeout if timeout is None else timeout,
        )

    async def mark_seen(
        self, labels: Sequence[str], now_ms: int, timeout: float | None = None
    ) -> None:
        """Note that the engines ``labels`` are followed now (their snapshots stay)."""
        redis = self.redis
        if labels:
            await redis.call(
                lambda: redis.client.hset(
                    redis.keys.snapshots_seen, mapping=dict.fromkeys(labels, now_ms)
                ),
                redis.admin_timeout if timeout is None else timeout,
            )

    async def drop_stale(self, before_ms: int, timeout: float | None = None) -> list[str]:
        """Delete the snapshots of engines no replica has followed since ``before_ms``
        (wall clock); returns their labels."""
        redis = self.redis
        keys = redis.keys
        timeout = redis.admin_timeout if timeout is None else timeout
        # Stored first, marks second: a snapshot stored in between has its mark already
        # (writers mark before they store), so it is never taken for an unmarked one.
        stored = await self.labels(timeout)
        seen = await redis.call(lambda: redis.client.hgetall(keys.snapshots_seen), timeout)
        marks = {_text(label): _text(at) for label, at in seen.items()}
        stale = {label for label, at in marks.items() if not at.isdigit() or int(at) < before_ms}
        stale |= {label for label in stored if label not in marks}
        if stale:
            gone = sorted(stale)

            async def run() -> None:
                pipe = redis.client.pipeline(transaction=False)
                pipe.hdel(keys.snapshots, *gone)
                pipe.hdel(keys.snapshots_seen, *gone)
                await pipe.execute()

            await redis.call(run, timeout)
        return sorted(stale)

    async def load(self, label: str, timeout: float | None = None) -> bytes | None:
        """One engine stream's stored snapshot (None: none)."""
        redis = self.redis
        raw = await redis.call(
            lambda: redis.client.hget(redis.keys.snapshots, label),
            redis.admin_timeout if timeout is None else timeout,
        )
        return None if raw is None else bytes(raw)

    async def labels(self, timeout: float | None = None) -> list[str]:
        """The engine labels stored snapshots are kept under."""
        redis = self.redis
        raw = await redis.call(
            lambda: redis.client.hkeys(redis.keys.snapshots),
            redis.admin_timeout if timeout is None else timeout,
        )
        return [_text(k) for k in raw]
