"""The KV-block index: which engines hold which block keys.

``base.py`` is the contract every backend implements, ``remote.py`` what a shared
backend adds to it; ``memory.py`` and ``redis.py`` are the backends, ``shadow.py`` the
router's wrapper of a shared one. The Redis connection the Redis backend and the
replicated mode run over is ``router/redis/``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.index.base import IndexStats, KVIndex, Match
from router.index.memory import MemoryIndex

if TYPE_CHECKING:
    from router.config import IndexConfig


def index_from_config(config: IndexConfig) -> KVIndex:
    """The backend ``index.backend`` selects, built from its own section (``index.redis``
    for Redis, which is imported only when chosen; ``index.replicated`` with it for the
    replicated mode)."""
    if config.backend == "redis":
        from router.index.redis import RedisIndex

        return RedisIndex.from_config(config.redis)
    if config.backend == "replicated":
        from router.index.replicated import ReplicatedIndex
        from router.redis.client import RedisClient, replica_id

        return ReplicatedIndex(
            RedisClient.from_config(config.redis),
            config.replicated,
            replica_id(),
            max_entries=config.max_entries,
            max_entries_per_engine=config.max_entries_per_engine,
        )
    return MemoryIndex(
        max_entries=config.max_entries, max_entries_per_engine=config.max_entries_per_engine
    )


__all__ = ["IndexStats", "KVIndex", "Match", "MemoryIndex", "index_from_config"]
