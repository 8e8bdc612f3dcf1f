"""Which engine holds each stored Responses API response, in Redis
(``{ns}:response:<id>``, one ``SET PX`` each), so that any replica finds it.

When ids are remembered, for how long, and what is asked when Redis is away is
:class:`~router.response_store.ResponseStore`'s; this module only writes and reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.redis.client import RedisClient


class ResponseEngines:
    """Response id -> the endpoint (``host:port``) of the engine holding it."""

    def __init__(self, redis: RedisClient) -> None:
        self.redis = redis

    async def remember(
        self, response_id: str, endpoint: str, ttl_ms: int, timeout: float | None = None
    ) -> None:
        """Record that the engine at ``endpoint`` holds ``response_id``, for ``ttl_ms``
        (one ``SET PX``). ``timeout`` defaults to ``admin_timeout``."""
        redis = self.redis
        key = redis.keys.response(response_id)
        await redis.call(
            lambda: redis.client.set(key, endpoint, px=int(ttl_ms)),
            redis.admin_timeout if timeout is None else timeout,
        )

    async def engine_of(self, response_id: str, timeout: float | None = None) -> str | None:
        """The endpoint of the engine holding ``response_id``, None when no replica
        recorded it (or it expired). ``timeout`` defaults to the budget."""
        redis = self.redis
        key = redis.keys.response(response_id)
        raw = await redis.call(
            lambda: redis.client.get(key), redis.budget if timeout is None else timeout
        )
        if raw is None:
            return None
        return raw.decode() if isinstance(raw, bytes) else str(raw)
