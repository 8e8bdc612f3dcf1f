"""The KV-block index: which engine holds which block keys."""

from router.index.base import IndexStats, KVIndex, Match
from router.index.memory import MemoryIndex

__all__ = ["IndexStats", "KVIndex", "Match", "MemoryIndex"]
