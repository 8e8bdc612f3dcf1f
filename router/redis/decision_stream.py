"""The decision stream in Redis (``{ns}:v3:decisions``): what replicas tell each other
at once, one stream entry per append.

An entry holds ``r`` (the replica's id), ``d`` (its routing decisions) and, when it has
some, ``s`` (session pins) and ``l`` (in-flight load changes). What the fields' bytes
mean, and what a replica does with its peers' entries, is
:class:`~router.index.replicated.DecisionSync`'s; this module only appends and reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.redis.client import RedisClient


class DecisionStream:
    """Appends to and reads the namespace's decision stream."""

    def __init__(self, redis: RedisClient) -> None:
        self.redis = redis

    async def publish(
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
        redis = self.redis
        fields = {"r": replica, "d": payload}
        if sessions is not None:
            fields["s"] = sessions
        if load is not None:
            fields["l"] = load
        entry = await redis.call(
            lambda: redis.client.xadd(
                redis.keys.decisions,
                fields,  # type: ignore[arg-type]
                minid=min_id,
                approximate=True,
            ),
            redis.admin_timeout if timeout is None else timeout,
            # Held to a looser time than the budget: its answer says nothing of whether
            # lookups are answered within it.
            reset_slow=False,
        )
        return entry.decode() if isinstance(entry, bytes) else str(entry)

    async def read(
        self, after: str, count: int, block_ms: int | None
    ) -> list[tuple[str, bytes, bytes, bytes, bytes]]:
        """Entries of the decision stream after id ``after``, oldest first, as (id,
        replica (bytes, as stored), payload, session pins, load changes; the last two
        empty when none); with ``block_ms``, waits that long for one to arrive. Bounded
        by the wait plus ``admin_timeout``; a blocking read's answer does not reset the
        count of slow calls (``slow_calls_to_outage``)."""
        redis = self.redis
        wait = (block_ms or 0) / 1000.0
        reply = await redis.call(
            lambda: redis.client.xread({redis.keys.decisions: after}, count=count, block=block_ms),
            wait + redis.admin_timeout,
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
