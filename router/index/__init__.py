"""The KV-block index: which engine holds which block keys."""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.index.base import IndexStats, KVIndex, Match
from router.index.memory import MemoryIndex

if TYPE_CHECKING:
    from router.config import IndexConfig


def index_from_config(config: IndexConfig) -> KVIndex:
    """The backend an ``index:`` section selects (Redis is imported only when chosen)."""
    if config.backend == "redis":
        from router.index.redis import RedisIndex

        return RedisIndex.from_config(config)
    return MemoryIndex()


__all__ = ["IndexStats", "KVIndex", "Match", "MemoryIndex", "index_from_config"]
