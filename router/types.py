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
    """Where an engine holds a block, fastest first: GPU, CPU (host memory), DISK (disk,
    shared storage and remote pools). A block held on several tiers counts at the first.

    ``OFFLOADED`` is the name of the CPU tier from when the router had one offload tier
    (an alias: ``Tier.OFFLOADED is Tier.CPU``); iterating the enum yields the three tiers.
    """

    GPU = 0
    CPU = 1
    OFFLOADED = 1
    DISK = 2

    @classmethod
    def from_medium(
        cls, medium: str | None, locality: str | None = None, ownership: str | None = None
    ) -> Tier:
        """The tier of an event's ``medium`` (vLLM ``GPU``/``CPU``/``STORAGE``, SGLang
        ``GPU``/``CPU_PINNED``/``DISK``/``EXTERNAL``, TensorRT-LLM ``GPU``/``CPU``...).

        No medium is the engine's primary tier (GPU). A ``REMOTE`` locality (a block held
        by another node's pool, vLLM 0.32) is the slowest tier whatever the medium; so is
        any medium not named here (disks, object stores, shared pools). ``ownership``
        (vLLM's secondary offloading tier id) names a residency, not a speed: it does not
        change the tier.
        """
        if locality is not None and locality.upper() == "REMOTE":
            return cls.DISK
        if medium is None:
            return cls.GPU
        name = medium.upper()
        if name in _GPU_MEDIA:
            return cls.GPU
        if name in _CPU_MEDIA:
            return cls.CPU
        return cls.DISK


_GPU_MEDIA = frozenset({"GPU", "HBM", "DEVICE"})
_CPU_MEDIA = frozenset({"CPU", "CPU_PINNED", "HOST", "HOST_PINNED", "DRAM"})
