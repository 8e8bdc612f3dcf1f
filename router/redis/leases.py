"""Leases in Redis: one holder per key at a time, for as long as it renews
(``router/index/lua/lease.lua``).

Two kinds are held: an engine stream's writer lease (``{ns}:v3:lease:<engine>``, taken
by ``kvroute indexer`` through :meth:`~router.index.redis.RedisIndex.lease`; the index's
fenced writes apply only under it) and the replicated mode's snapshot lease
(``{ns}:v3:snapshot-lease``, :class:`~router.redis.snapshot_store.SnapshotStore`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.redis.client import RedisClient, Script

if TYPE_CHECKING:
    from router.index.remote import LeaseMode

LEASE = Script("lease.lua")


async def lease(
    redis: RedisClient,
    key: str,
    token: str,
    ttl_ms: int,
    mode: LeaseMode,
    timeout: float | None = None,
) -> bool:
    """Acquire (``SET NX PX``, or extend if ``token`` holds it), ``renew`` or
    ``release`` the lease ``key``; True when ``token`` holds it after (or released it).
    ``timeout`` defaults to the client's ``admin_timeout``."""
    if mode not in ("acquire", "renew", "release"):
        raise ValueError(f"unknown lease mode {mode!r}")
    reply = await redis.call(
        lambda: redis.evalsha(LEASE, [key], [token, int(ttl_ms), mode]),
        redis.admin_timeout if timeout is None else timeout,
    )
    return reply == 1
