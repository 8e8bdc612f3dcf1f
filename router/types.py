"""Types shared across the router's layers."""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple


class EngineKey(NamedTuple):
    """A routing target: an engine endpoint (``host:port``) and a data-parallel rank.

    A vLLM or SGLang server with DP ranks keeps one cache and one scheduler per rank, so
    each rank is its own target; index entries, load and event sequences are per rank.
    """

    endpoint: str
    rank: int = 0

    @property
    def label(self) -> str:
        """Stable text form used in logs, metric labels, headers and Redis keys."""
        return self.endpoint if self.rank == 0 else f"{self.endpoint}#dp{self.rank}"

    @classmethod
    def parse(cls, label: str) -> EngineKey:
        endpoint, sep, rank = label.partition("#dp")
        return cls(endpoint, int(rank) if sep else 0)

    def __str__(self) -> str:
        return self.label


class Tier(IntEnum):
    """Where an engine holds a block. Offloaded tiers (CPU, disk) are slower to reuse."""

    GPU = 0
    OFFLOADED = 1

    @classmethod
    def from_medium(cls, medium: str | None) -> Tier:
        return cls.GPU if medium is None or medium.upper() == "GPU" else cls.OFFLOADED
