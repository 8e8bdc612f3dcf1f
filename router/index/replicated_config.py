"""The settings of the replicated index (router/index/replicated.py): the
``index.replicated`` section of the configuration."""

from __future__ import annotations

from pydantic import Field

from router.config_section import Section


class ReplicatedIndexConfig(Section):
    """Replicated mode (``index.backend: replicated``; docs/redis-schema.md "Replicated
    mode"): each replica keeps the index in memory, fed by the engines' KV events it
    follows itself, and the replicas share their routing decisions through a Redis stream
    (``index.redis`` says which Redis; load is shared as with `redis`)."""

    sync_interval_s: float = Field(
        0.001,
        ge=0,
        le=1,
        description="Least time between two rounds of appends of one replica to the "
        "decision stream. A decision made after a quiet interval is published at once "
        "(peers have it about a Redis round trip later); under load the decisions of one "
        "interval share an entry (`max_batch` at most), so each replica appends about "
        "1/interval times a second whatever the decision rate. 0: append whenever the "
        "previous append is done.",
    )
    window_s: float = Field(
        10.0,
        gt=0,
        description="How long the decision stream keeps entries: a replica that starts, or "
        "comes back from a partition, replays the entries this recent (those whose records "
        "are still live). Keep it at least `policy.provisional_ttl_s`; records of engines "
        "without KV events (`policy.approximate_ttl_s`) older than it are not replayed. "
        "The stream holds about decisions/s x window x 8 bytes per prompt block.",
    )
    max_pending: int = Field(
        10_000,
        ge=1,
        description="Decisions a replica keeps for publishing while Redis is unreachable "
        "(oldest dropped first, `kvroute_replica_sync_dropped_total`); those still live are "
        "published when it answers again.",
    )
    max_batch: int = Field(
        256,
        ge=1,
        description="Decisions in one stream entry at most.",
    )
    snapshot_interval_s: float = Field(
        30.0,
        ge=0,
        description="Seconds between snapshots of what the engines hold (their event "
        "streams' state), written to Redis by one replica (a lease elects it). A replica "
        "that starts loads them and replays each engine's events from the snapshot's "
        "sequence number instead of waiting for new events. 0: no snapshots.",
    )
