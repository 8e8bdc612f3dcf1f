"""The names of a namespace's Redis keys and how block keys are packed into values.

docs/redis-schema.md has every key, its type, who writes it and why. All keys live under
the hash tag ``{namespace}``, so a namespace sits in one Redis Cluster slot and a script
may touch all of it; the index's own keys, the decision stream and the snapshots also
carry the layout's version (:data:`LAYOUT`) after the tag.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

from router.types import EngineKey, Tier

_NATIVE_LE = sys.byteorder == "little"

LAYOUT = 3
"""The layout of the index's keys and values (docs/redis-schema.md): 3 since tables
keyed by block key are bucketed; 2 gave the disk tier a third tier bit (``engine id x 8
+ tier bits``). It is part of every index key's name (``{ns}:v3:blocks``), so a router
of another layout never reads keys it would misread: it builds its own from replay and
events, and routers of both layouts can share a namespace during a rolling upgrade."""


class Keys:
    """Key names under the namespace's hash tag: the index's under the layout's prefix,
    the load exchange, the incarnation marker and stored responses beside it (their
    values do not depend on the index's layout)."""

    def __init__(self, namespace: str) -> None:
        if "{" in namespace or "}" in namespace:
            raise ValueError(f"Redis namespace {namespace!r} must not contain braces")
        self.tag = f"{{{namespace}}}:"
        self.prefix = f"{self.tag}v{LAYOUT}:"
        p = self.prefix
        self.fixed = (
            f"{p}blocks",
            f"{p}expiring-adds",
            f"{p}engines",
            f"{p}engine-free",
            f"{p}engine-next",
            f"{p}gc",
            f"{p}engine-epoch",
            f"{p}records",
            f"{p}shared",
        )
        f = self.fixed
        self.lookup = (f[0], f[2], f[6], f[7], f[8])
        self.incarnation = f"{self.tag}incarnation"
        self.load = f"{self.tag}load"
        # Between replicas (router.redis.decision_stream, router.redis.snapshot_store):
        # the decision stream, the engines' stream snapshots and the lease of the replica
        # that writes them.
        self.decisions = f"{p}decisions"
        self.snapshots = f"{p}snapshots"
        self.snapshots_seen = f"{p}snapshots-seen"
        self.snapshot_lease = f"{p}snapshot-lease"
        self._engine: dict[EngineKey, tuple[str, ...]] = {}

    def held(self, engine_id: int, tier: Tier) -> str:
        """The meta key of an engine id's holdings table of ``tier``."""
        return f"{self.prefix}held:{engine_id}:{int(tier)}"

    def response(self, response_id: str) -> str:
        """The key naming the engine that holds a stored Responses API response."""
        return f"{self.tag}response:{response_id}"

    def engine(self, engine: EngineKey) -> tuple[str, ...]:
        """Fixed keys plus the engine's own, as write.lua takes them (its holdings
        tables are named by its engine id, inside the script)."""
        keys = self._engine.get(engine)
        if keys is None:
            p, label = self.prefix, engine.label
            keys = (
                *self.fixed,
                f"{p}expiring:{label}",
                f"{p}expiring-n:{label}",
                f"{p}stream:{label}",
                f"{p}lease:{label}",
            )
            self._engine[engine] = keys
        return keys

    def lease(self, engine: EngineKey) -> str:
        """The key of the engine stream's writer lease."""
        return self.engine(engine)[12]

    def stream(self, engine: EngineKey) -> str:
        """The key of the engine stream's last applied batch (``seq``, ``ts``)."""
        return self.engine(engine)[11]


def pack_keys(keys: Sequence[int]) -> bytes:
    """Block keys (or engine hashes) as back-to-back 8-byte little-endian strings."""
    packed = array("Q", keys)
    if not _NATIVE_LE:
        packed.byteswap()
    return packed.tobytes()


def unpack_key(raw: bytes) -> int:
    """One 8-byte little-endian key as stored in Redis."""
    return int.from_bytes(raw, "little")
