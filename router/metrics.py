"""kvroute's Prometheus metrics: the request-path instruments and the scrape-time
collector. Every family is an entry of :mod:`router.metric_catalogue` (the names,
types, help texts and labels docs/metrics.md documents: a contract).

Request-path metrics are updated where things happen. What the core, the index, the
subscriber, the registry and the other components already count is exported at scrape
time by each component's ``metric_families``, which :class:`StateCollector` calls for
the components it is given, so it costs nothing per request and per-engine series vanish
with their engine (label sets stay bounded by the fleet).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.registry import Collector

from router import __version__, hashing
from router.metric_catalogue import (
    AUTH_REFUSALS,
    BUILD_INFO,
    CLIENT_GONE_AT_END,
    CLIENT_HANDOFF_FIELDS_REMOVED,
    DECODE_LEG_FIRST_BYTE_SECONDS,
    DISAGG_DECISIONS,
    DISAGG_LINKS,
    EXTPROC_REQUESTS,
    FIRST_BYTE_TIMEOUTS,
    GRPC_REQUESTS,
    HANDOFF_ABANDONED_TOKENS,
    HANDOFF_LOOPBACK_HOSTS,
    HANDOFFS,
    KV_TRANSFER_BYTES_ESTIMATED,
    NATIVE_HELPER,
    PICKS,
    PICKS_OPEN,
    PREFILL_LEG_SECONDS,
    PREFIX_MATCH_RATIO,
    REQUEST_SECONDS,
    REQUESTS,
    RESPONSES_AFFINITY,
    RESPONSES_ENGINE_QUERIES,
    RETRIES,
    ROUTING_SECONDS,
    TTFT_SECONDS,
)

if TYPE_CHECKING:
    from router.admission import Admission
    from router.core import RoutingCore
    from router.events.ingest import IngestCounters
    from router.events.snapshots import SnapshotWriter
    from router.events.subscriber import SubscriberStats
    from router.events.writer import WriterStats
    from router.fleet.registry import Registry
    from router.fleet.shared_load import SharedLoad
    from router.flow.control import FlowControl
    from router.index.base import IndexStats
    from router.index.replicated import DecisionSync, ReplicatedIndex
    from router.index.shadow import ShadowedIndex
    from router.metric_catalogue import StateFamily
    from router.serving.picks import PickLedger
    from router.tokenization import Tokenizers

# ``*_created`` series double the output and nobody alerts on them.
disable_created_metrics()


class Reports(Protocol):
    """A component that exports what it counts at scrape time."""

    def metric_families(self) -> Iterator[StateFamily]: ...


@dataclass(slots=True)
class StateSources:
    """Where the scrape-time values come from (any may be absent)."""

    core: RoutingCore | None = None
    registry: Registry | None = None
    ingest: IngestCounters | None = None
    subscriber: SubscriberStats | None = None
    index_stats: Callable[[], IndexStats | None] | None = None
    tokenizers: Tokenizers | None = None
    admission: Admission | None = None
    shadowed: ShadowedIndex | None = None
    """The Redis index of a router, with its shadow (absent with the memory index)."""
    shared_load: SharedLoad | None = None
    replicated: ReplicatedIndex | None = None
    """The replicated mode's index (decision sharing through Redis)."""
    session_sync: DecisionSync | None = None
    """The shared index's follower of the decision stream (the ``latency`` policy's
    session pins, in-flight load changes), when there is one."""
    snapshots: SnapshotWriter | None = None
    """The replicated mode's writer of engine stream snapshots."""
    writer: WriterStats | None = None
    """The router's KV-event writer into Redis."""
    picks: PickLedger | None = None
    connections: Reports | None = None
    """The HTTP listener's connection cap and timeouts (its connection guard)."""
    flow: FlowControl | None = None
    """Flow control (``flow.enabled``): bands, tenants, rate limits, saturation."""


class StateCollector(Collector):
    """Exports what the components count and hold, each through its own
    ``metric_families``, at scrape time."""

    def __init__(self, sources: StateSources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[StateFamily]:
        src = self.sources
        yield BUILD_INFO.labelled([((__version__,), 1)])
        yield NATIVE_HELPER.value(1 if hashing.NATIVE else 0)
        if src.core is not None:
            yield from src.core.metric_families(src.shadowed)
        if src.admission is not None:
            yield from src.admission.metric_families()
        if src.flow is not None:
            yield from src.flow.metric_families()
        if src.connections is not None:
            yield from src.connections.metric_families()
        if src.registry is not None and src.core is not None:
            yield from src.registry.metric_families()
            peers = src.shared_load is not None
            yield from src.core.loads.metric_families(src.registry.engine_keys(), peers)
        if src.tokenizers is not None:
            yield from src.tokenizers.metric_families()
        if src.shadowed is not None:
            yield from src.shadowed.metric_families()
        if src.shared_load is not None:
            yield from src.shared_load.metric_families()
        if src.replicated is not None:
            yield from src.replicated.metric_families(src.snapshots)
        if src.session_sync is not None:
            # In the replicated mode it is the index's own follower, reported above.
            yield from src.session_sync.session_families(errors=src.replicated is None)
        if src.writer is not None:
            yield from src.writer.metric_families()
        if src.index_stats is not None and (stats := src.index_stats()) is not None:
            yield from stats.metric_families()
        if src.picks is not None:
            yield from src.picks.metric_families()
        if src.ingest is not None:
            fleet = {e.endpoint for e in src.registry} if src.registry is not None else None
            yield from src.ingest.metric_families(fleet)
        if src.subscriber is not None:
            yield from src.subscriber.metric_families()


class RouterMetrics:
    """The request-path metrics, in a registry of their own (tests run many routers)."""

    def __init__(self, sources: StateSources | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = REQUESTS.counter(r)
        self.auth_refusals = AUTH_REFUSALS.counter(r)
        self.client_gone_at_end = CLIENT_GONE_AT_END.counter(r)
        self.retries = RETRIES.counter(r)
        self.first_byte_timeouts = FIRST_BYTE_TIMEOUTS.counter(r)
        self.prefix_match = PREFIX_MATCH_RATIO.histogram(r)
        self.routing_seconds = ROUTING_SECONDS.histogram(r)
        self.ttft_seconds = TTFT_SECONDS.histogram(r)
        self.request_seconds = REQUEST_SECONDS.histogram(r)
        self.disagg = DISAGG_DECISIONS.counter(r)
        self.disagg_links = DISAGG_LINKS.counter(r)
        self.handoffs = HANDOFFS.counter(r)
        self.prefill_leg_seconds = PREFILL_LEG_SECONDS.histogram(r)
        self.decode_leg_first_byte_seconds = DECODE_LEG_FIRST_BYTE_SECONDS.histogram(r)
        self.transfer_bytes = KV_TRANSFER_BYTES_ESTIMATED.counter(r)
        self.loopback_hosts = HANDOFF_LOOPBACK_HOSTS.counter(r)
        self.handoff_fields_removed = CLIENT_HANDOFF_FIELDS_REMOVED.counter(r)
        self.responses_affinity = RESPONSES_AFFINITY.counter(r)
        self.responses_queries = RESPONSES_ENGINE_QUERIES.counter(r)
        self.abandoned_tokens = HANDOFF_ABANDONED_TOKENS.counter(r)
        self.grpc_requests = GRPC_REQUESTS.counter(r)
        self.picks = PICKS.counter(r)
        self.picks_open = PICKS_OPEN.gauge(r)
        self.extproc_requests = EXTPROC_REQUESTS.counter(r)
        self.state = StateCollector(sources or StateSources())
        r.register(self.state)

    def watch_picks(self, picks: PickLedger) -> None:
        """Export the pick ledger's open count and endings at scrape time."""
        self.picks_open.set_function(lambda: picks.open_count)
        self.state.sources.picks = picks
