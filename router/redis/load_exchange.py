"""The replicas' in-flight load in Redis: one hash field per replica (``{ns}:load``),
written and read back in one script call (``router/index/lua/load.lua``).

What a payload holds and how replicas fold each other's figures into their load view
is :mod:`router.fleet.shared_load`'s; this module only moves the bytes.
"""

from __future__ import annotations

from router.redis.client import RedisClient, Script

LOAD = Script("load.lua")


class LoadExchange:
    """Each replica's load payload, kept in Redis for a ttl after each exchange."""

    def __init__(self, redis: RedisClient) -> None:
        self.redis = redis
        redis.register(LOAD)

    async def share(
        self, replica: str, payload: bytes | None, ttl_ms: int, timeout: float | None = None
    ) -> dict[str, bytes]:
        """Publish this replica's load ``payload`` for ``ttl_ms`` (None: withdraw it) and
        return the other live replicas' payloads by replica id, in one script call.
        ``timeout`` defaults to the client's ``admin_timeout``."""
        redis = self.redis
        args = [replica, b"" if payload is None else payload, int(ttl_ms)]
        flat = await redis.call(
            lambda: redis.evalsha(LOAD, [redis.keys.load], args),
            redis.admin_timeout if timeout is None else timeout,
        )
        return {
            (k.decode() if isinstance(k, bytes) else k): v
            for k, v in zip(flat[::2], flat[1::2], strict=True)
        }
