"""kvroute's Prometheus metrics. Every name here is listed in docs/metrics.md: a contract.

Request-path metrics are updated where things happen. Everything the core, the index,
the subscriber and the registry already count is read at scrape time by
:class:`StateCollector`, so it costs nothing per request and per-engine series vanish
with their engine (label sets stay bounded by the fleet).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router import __version__, hashing

if TYPE_CHECKING:
    from router.admission import Admission
    from router.api.listener import ConnectionGuard
    from router.api.picks import PickLedger
    from router.core import RoutingCore
    from router.engines.registry import Registry
    from router.engines.shared_load import SharedLoad
    from router.events.ingest import IngestCounters
    from router.events.snapshots import SnapshotWriter
    from router.events.subscriber import SubscriberStats
    from router.events.writer import WriterStats
    from router.flow.control import FlowControl
    from router.index.base import IndexStats
    from router.index.replicated import DecisionSync, ReplicatedIndex, SyncCounters
    from router.index.shadow import ShadowedIndex
    from router.tokenization import Tokenizers

# ``*_created`` series double the output and nobody alerts on them.
disable_created_metrics()

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
)
OVERHEAD_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


_Family = TypeVar("_Family", GaugeMetricFamily, CounterMetricFamily)


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
    connections: ConnectionGuard | None = None
    """The HTTP listener's connection cap and timeouts."""
    flow: FlowControl | None = None
    """Flow control (``flow.enabled``): bands, tenants, rate limits, saturation."""


class StateCollector(Collector):
    """Exports counters and state kept elsewhere, computed at scrape time."""

    def __init__(self, sources: StateSources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        src = self.sources
        info = GaugeMetricFamily("kvroute_build_info", "kvroute version", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        yield GaugeMetricFamily(
            "kvroute_native_helper",
            "1 when block keys are computed by the compiled helper, 0 on the pure-Python path",
            value=1 if hashing.NATIVE else 0,
        )
        if src.core is not None:
            decisions = CounterMetricFamily(
                "kvroute_decisions",
                "Routing decisions by policy and reason",
                labels=["policy", "reason"],
            )
            for (policy, reason), n in sorted(src.core.counters.decisions.items()):
                decisions.add_metric([policy, reason], n)
            yield decisions
            errors = src.core.counters.index_errors
            if src.shadowed is not None:
                errors += src.shadowed.counters.errors
            yield CounterMetricFamily(
                "kvroute_index_errors", "Index calls that failed or ran over budget", value=errors
            )
            yield GaugeMetricFamily(
                "kvroute_index_available",
                "1 while the KV-block index answers (Redis reachable within budget)",
                value=1.0 if src.shadowed is None or src.shadowed.available else 0.0,
            )
            yield GaugeMetricFamily(
                "kvroute_inflight_requests",
                "Requests in flight through this router",
                value=src.core.loads.in_flight,
            )
        if src.admission is not None:
            yield GaugeMetricFamily(
                "kvroute_admission_inflight",
                "Requests holding one of the limits.max_inflight slots",
                value=src.admission.in_flight,
            )
            yield GaugeMetricFamily(
                "kvroute_admission_reading_body",
                "Requests holding a slot while their body is still being read",
                value=src.admission.reading_body,
            )
            yield GaugeMetricFamily(
                "kvroute_admission_waiting",
                "Requests waiting in the admission queue for a slot or an engine with room",
                value=src.admission.waiting,
            )
            rejected = CounterMetricFamily(
                "kvroute_admission_rejected",
                "Requests answered 429 by admission control, by reason",
                labels=["reason"],
            )
            for reason, n in sorted(src.admission.rejected.items()):
                rejected.add_metric([reason], n)
            yield rejected
        if src.flow is not None:
            yield from self._flow(src.flow)
        if src.connections is not None:
            yield from self._connections(src.connections)
        if src.registry is not None and src.core is not None:
            yield from self._engines(src.registry, src.core)
        if src.tokenizers is not None:
            mismatches = CounterMetricFamily(
                "kvroute_tokenizer_mismatches",
                "Answers whose prompt-token count differed from the router's",
                labels=["model"],
            )
            for model, n in sorted(src.tokenizers.mismatches().items()):
                mismatches.add_metric([model], n)
            yield mismatches
            modes = GaugeMetricFamily(
                "kvroute_tokenizer_mode",
                "1 for the tokenizer mode each model's pool uses",
                labels=["model", "mode"],
            )
            for model, mode in sorted(src.tokenizers.modes().items()):
                modes.add_metric([model, mode], 1)
            yield modes
            pools = src.tokenizers.describe()
            sources = GaugeMetricFamily(
                "kvroute_tokenizer_source",
                "1 for where each model's pool got its tokenizer (tokenizer.mode auto: "
                "engine, model_dirs, hf_cache, hub, probe, none, pending, guard; configured)",
                labels=["model", "source"],
            )
            chars = GaugeMetricFamily(
                "kvroute_tokenizer_chars_per_token",
                "Characters per pseudo-token of each model's pool in approximate mode",
                labels=["model"],
            )
            for pool in pools:
                sources.add_metric([pool["model"], pool["source"]], 1)
                if pool["chars_per_token"] is not None:
                    chars.add_metric([pool["model"]], pool["chars_per_token"])
            yield sources
            yield chars
        if src.shadowed is not None:
            yield from self._shadowed(src.shadowed)
        if src.shared_load is not None:
            yield GaugeMetricFamily(
                "kvroute_load_peers",
                "Other router replicas whose in-flight load this router counts",
                value=src.shared_load.peers,
            )
            yield CounterMetricFamily(
                "kvroute_load_changes_sent",
                "Engines' in-flight figures this replica sent to its peers on the decision "
                "stream between exchanges (index.redis.load_push)",
                value=src.shared_load.pushed,
            )
            yield CounterMetricFamily(
                "kvroute_load_changes_applied",
                "Peers' in-flight figures from the decision stream newer than what this "
                "replica had",
                value=src.shared_load.applied,
            )
        if src.replicated is not None:
            yield from self._replicated(src.replicated)
        if src.session_sync is not None:
            c = src.session_sync.counters
            yield CounterMetricFamily(
                "kvroute_session_pins_published",
                "Session pins (the latency policy's affinity) this replica shared through Redis",
                value=c.sessions_published,
            )
            yield CounterMetricFamily(
                "kvroute_session_pins_learnt",
                "Session pins other replicas shared that this replica learnt",
                value=c.sessions_applied,
            )
            if src.replicated is None:  # the shared index's follower of the stream
                yield _sync_errors(c)
        if src.writer is not None:
            yield CounterMetricFamily(
                "kvroute_kv_event_resnapshots",
                "Engine streams rewritten into Redis from their state after writes were lost",
                value=src.writer.resnapshots,
            )
        if src.index_stats is not None:
            stats = src.index_stats()
            if stats is not None:
                yield GaugeMetricFamily(
                    "kvroute_index_blocks", "Distinct block keys in the index", value=stats.blocks
                )
                yield GaugeMetricFamily(
                    "kvroute_index_entries",
                    "(block, engine, tier) records in the index",
                    value=stats.entries,
                )
                if stats.bytes is not None:
                    yield GaugeMetricFamily(
                        "kvroute_index_bytes",
                        "Bytes the in-memory index's compiled tables hold",
                        value=stats.bytes,
                    )
                evictions = CounterMetricFamily(
                    "kvroute_index_evictions",
                    "Index records evicted for room (index.max_entries_per_engine, "
                    "index.max_entries), by cause",
                    labels=["reason"],
                )
                for reason in ("engine_cap", "index_cap"):
                    evictions.add_metric([reason], stats.evicted.get(reason, 0))
                yield evictions
        if src.picks is not None:
            ended = CounterMetricFamily(
                "kvroute_picks_ended",
                "Picks whose load was released, by how (released, expired, stream_end)",
                labels=["how"],
            )
            for how in ("released", "expired", "stream_end"):
                ended.add_metric([how], src.picks.counters.ended.get(how, 0))
            yield ended
        if src.ingest is not None:
            events = CounterMetricFamily(
                "kvroute_kv_events", "KV events applied, by type", labels=["type"]
            )
            for kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
                events.add_metric([kind], src.ingest.events.get(kind, 0))
            yield events
            skipped = CounterMetricFamily(
                "kvroute_kv_events_skipped", "KV events not applied, by reason", labels=["reason"]
            )
            for reason, n in sorted(src.ingest.skipped.items()):
                skipped.add_metric([reason], n)
            yield skipped
            yield CounterMetricFamily(
                "kvroute_kv_event_hashes_forgotten",
                "Engine block hashes dropped from full per-stream maps "
                "(index.max_entries_per_engine)",
                value=src.ingest.forgotten_hashes,
            )
            yield CounterMetricFamily(
                "kvroute_kv_event_unknown_fields",
                "Fields of applied KV events this version does not read (ignored)",
                value=src.ingest.unknown_fields,
            )
            mismatched = CounterMetricFamily(
                "kvroute_kv_events_block_size_mismatch",
                "BlockStored events dropped because their block size is not the engine's",
                labels=["engine"],
            )
            known = {e.endpoint for e in src.registry} if src.registry is not None else None
            for key, n in sorted(src.ingest.block_size_mismatches.items()):
                if known is None or key.endpoint in known:  # removed engines disappear
                    mismatched.add_metric([key.label], n)
            yield mismatched
        if src.subscriber is not None:
            sub = src.subscriber
            yield CounterMetricFamily(
                "kvroute_kv_event_batches", "KV-event batches applied", value=sub.batches
            )
            yield CounterMetricFamily(
                "kvroute_kv_event_gaps", "Sequence gaps seen in KV-event streams", value=sub.gaps
            )
            replays = CounterMetricFamily(
                "kvroute_kv_event_replays", "Replay requests by outcome", labels=["outcome"]
            )
            for outcome in ("ok", "uncovered", "failed"):
                replays.add_metric([outcome], sub.replays.get(outcome, 0))
            yield replays
            yield CounterMetricFamily(
                "kvroute_kv_event_restarts",
                "Engine restarts detected from sequence numbers",
                value=sub.restarts,
            )
            yield CounterMetricFamily(
                "kvroute_kv_event_garbage",
                "Undecodable KV-event frames dropped",
                value=sub.garbage,
            )
            yield CounterMetricFamily(
                "kvroute_kv_events_address_mismatch",
                "Bound-socket messages dropped: their topic names an engine at another "
                "address than the publisher's",
                value=sub.address_mismatches,
            )
            yield CounterMetricFamily(
                "kvroute_kv_event_publishers_refused",
                "Bound-socket publisher handshakes refused for a CURVE key not admitted",
                value=sub.publishers_refused,
            )
            lag = GaugeMetricFamily(
                "kvroute_kv_event_lag_seconds",
                "Publish-to-apply delay of the last batch",
                labels=["engine"],
            )
            for engine, seconds in sorted(sub.lag.items()):
                lag.add_metric([engine.label], seconds)
            yield lag

    def _replicated(
        self, index: ReplicatedIndex
    ) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        sync = index.sync
        c = sync.counters
        yield CounterMetricFamily(
            "kvroute_replica_sync_published",
            "This replica's routing decisions appended to the shared decision stream",
            value=c.published,
        )
        yield CounterMetricFamily(
            "kvroute_replica_sync_entries",
            "Entries this replica appended to the decision stream (decisions batched)",
            value=c.entries,
        )
        yield CounterMetricFamily(
            "kvroute_replica_sync_applied",
            "Other replicas' decisions recorded in this replica's index",
            value=c.applied,
        )
        yield CounterMetricFamily(
            "kvroute_replica_sync_expired",
            "Other replicas' decisions read after their records' life had ended",
            value=c.expired,
        )
        dropped = CounterMetricFamily(
            "kvroute_replica_sync_dropped",
            "This replica's decisions never published, by reason",
            labels=["reason"],
        )
        for reason in ("queue_full", "expired"):
            dropped.add_metric([reason], c.dropped.get(reason, 0))
        yield dropped
        yield _sync_errors(c)
        yield GaugeMetricFamily(
            "kvroute_replica_sync_pending",
            "This replica's decisions waiting to be published",
            value=sync.pending,
        )
        yield CounterMetricFamily(
            "kvroute_replica_snapshots_written",
            "Engine stream snapshots this replica wrote to Redis (while it holds the lease)",
            value=self.sources.snapshots.written if self.sources.snapshots else 0,
        )
        yield GaugeMetricFamily(
            "kvroute_replica_sync_delay_seconds",
            "From decision to record in this index, for the last peer decision applied",
            value=c.delay_s,
        )

    def _shadowed(self, index: ShadowedIndex) -> Iterator[CounterMetricFamily]:
        counters = index.counters
        yield CounterMetricFamily(
            "kvroute_index_outages",
            "Times Redis became unreachable or slower than the budget",
            value=index.remote.counters.outages,
        )
        yield CounterMetricFamily(
            "kvroute_index_slow_calls",
            "Redis calls over the budget that did not mark Redis unavailable",
            value=index.remote.counters.slow_calls,
        )
        yield CounterMetricFamily(
            "kvroute_index_fallbacks",
            "Lookups answered from this router's shadow of recent decisions",
            value=counters.fallbacks,
        )
        yield CounterMetricFamily(
            "kvroute_index_unwritten_records",
            "Decision records that did not reach Redis when made",
            value=counters.unwritten,
        )
        yield CounterMetricFamily(
            "kvroute_index_replayed_records",
            "Decision records written to Redis from the shadow after an outage",
            value=counters.replayed,
        )

    def _connections(
        self, guard: ConnectionGuard
    ) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily(
            "kvroute_http_connections",
            "Client connections open on the HTTP listener",
            value=guard.open,
        )
        yield CounterMetricFamily(
            "kvroute_http_connections_refused",
            "Client connections closed on arrival: server.max_connections were open",
            value=guard.refused,
        )
        timeouts = CounterMetricFamily(
            "kvroute_http_timeouts",
            "Client connections closed because a request's head or body came too slowly",
            labels=["phase"],
        )
        for phase, n in sorted(guard.timeouts.items()):
            timeouts.add_metric([phase], n)
        yield timeouts
        yield CounterMetricFamily(
            "kvroute_http_malformed_requests",
            "Requests answered 400 before any handler: unparseable, or an Expect not UTF-8",
            value=guard.malformed,
        )

    def _flow(self, flow: FlowControl) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield _family(
            GaugeMetricFamily,
            "kvroute_pool_saturation",
            "How full each model's pool is, 0 to 1 (flow control sheds at flow.saturation.shed_at)",
            ["model"],
            {(model,): value for model, value in flow.saturation.all().items()},
        )
        counts: dict[tuple[str, ...], float] = {}
        for (band, tenant), n in flow.queue.counts().items():
            key = (str(band), flow.tenant_label(tenant))
            counts[key] = counts.get(key, 0) + n
        yield _family(
            GaugeMetricFamily,
            "kvroute_flow_waiting",
            "Requests waiting in the admission queue, by priority band and tenant",
            ["band", "tenant"],
            counts,
        )
        yield _family(
            CounterMetricFamily,
            "kvroute_flow_admitted",
            "Requests flow control admitted, by priority band",
            ["band"],
            {(band,): n for band, n in flow.admitted.items()},
        )
        yield _family(
            CounterMetricFamily,
            "kvroute_flow_wait_seconds",
            "Seconds admitted requests waited in the admission queue, by priority band",
            ["band"],
            {(band,): n for band, n in flow.wait_sum.items()},
        )
        yield _family(
            CounterMetricFamily,
            "kvroute_flow_refused",
            "Requests flow control refused, by priority band and reason (shed, rpm, tpm, "
            "band_full, timeout)",
            ["band", "reason"],
            dict(flow.refused),
        )
        yield CounterMetricFamily(
            "kvroute_rate_limit_fallbacks",
            "Rate-limit decisions made by local buckets because Redis did not answer",
            value=flow.limiter.fallbacks,
        )
        if flow.isolation is not None:
            c = flow.isolation.counters
            yield _family(
                CounterMetricFamily,
                "kvroute_flow_prefill_isolation",
                "Prefill isolation (flow.prefill_isolation): decisions that left out an "
                "engine prefilling an outranking request (avoided), decisions kept off "
                "engines reserved for outranking requests (reserved), requests that waited "
                "for such prefills to end (waited), requests routed beside them (overridden)",
                ["outcome"],
                {
                    ("avoided",): c.avoided,
                    ("reserved",): c.reserved,
                    ("waited",): c.waited,
                    ("overridden",): c.overridden,
                },
            )
            yield CounterMetricFamily(
                "kvroute_flow_prefill_isolation_wait_seconds",
                "Seconds requests waited for outranking prefills to end",
                value=c.wait_s,
            )

    def _engines(self, registry: Registry, core: RoutingCore) -> Iterator[GaugeMetricFamily]:
        healthy = GaugeMetricFamily(
            "kvroute_engine_healthy", "1 if the engine takes requests", labels=["engine"]
        )
        refused = GaugeMetricFamily(
            "kvroute_engine_refused",
            "1 if the engine is refused (e.g. its block size differs from its pool's)",
            labels=["engine"],
        )
        inflight = GaugeMetricFamily(
            "kvroute_engine_inflight_requests",
            "Requests this router has in flight there",
            labels=["engine"],
        )
        prefill = GaugeMetricFamily(
            "kvroute_engine_queued_prefill_tokens",
            "Prompt tokens this router sent there whose first token has not come back",
            labels=["engine"],
        )
        ejections = CounterMetricFamily(
            "kvroute_engine_ejections", "Times the engine was ejected", labels=["engine"]
        )
        peer_inflight = GaugeMetricFamily(
            "kvroute_engine_peer_inflight_requests",
            "Requests other router replicas have in flight there (shared through Redis)",
            labels=["engine"],
        )
        peer_prefill = GaugeMetricFamily(
            "kvroute_engine_peer_queued_prefill_tokens",
            "Prompt tokens other router replicas sent there whose first token has not come back",
            labels=["engine"],
        )
        view = core.loads.view
        for engine in registry:
            healthy.add_metric([engine.endpoint], 1.0 if engine.state.value == "healthy" else 0.0)
            refused.add_metric([engine.endpoint], 1.0 if engine.state.value == "refused" else 0.0)
            ejections.add_metric([engine.endpoint], engine.ejections)
            for key in engine.keys:
                load = view.get(key)
                own = load.own() if load else None
                inflight.add_metric([key.label], own.requests if own else 0)
                prefill.add_metric([key.label], own.prefill_tokens if own else 0)
                peer_inflight.add_metric([key.label], load.peer_requests if load else 0)
                peer_prefill.add_metric([key.label], load.peer_prefill_tokens if load else 0)
        yield healthy
        yield refused
        yield inflight
        yield prefill
        yield ejections
        if self.sources.shared_load is not None:
            yield peer_inflight
            yield peer_prefill
        yield from self._latency(registry, core)

    @staticmethod
    def _latency(
        registry: Registry, core: RoutingCore
    ) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """The online latency model's lines per engine and the latency policy's SLO count."""
        model = core.loads.latency
        if model is not None:
            gauges = {
                name: GaugeMetricFamily(f"kvroute_engine_{name}", text, labels=["engine"])
                for name, text in (
                    ("prefill_seconds_per_token", "Fitted prefill time per uncached prompt token"),
                    ("ttft_overhead_seconds", "Fitted time to a first token, nothing to prefill"),
                    ("tpot_base_seconds", "Fitted time per output token of a lone sequence"),
                    (
                        "tpot_seconds_per_sequence",
                        "Fitted time each other decoding sequence adds per output token",
                    ),
                )
            }
            offered = GaugeMetricFamily(
                "kvroute_engine_prefill_utilization",
                "Prefill seconds offered to the engine per second lately (its recent uncached "
                "prompt tokens per second, all replicas', times its fitted prefill time per "
                "token): the busy term of the default policy",
                labels=["engine"],
            )
            view = core.loads.view
            now = time.monotonic()
            observed = CounterMetricFamily(
                "kvroute_engine_latency_observations",
                "First tokens (ttft) and finished streams (tpot) the latency model learnt from",
                labels=["engine", "kind"],
            )
            for engine in registry:
                for key in engine.keys:
                    fit = model.engines.get(key)
                    if fit is None:
                        continue
                    label = [key.label]
                    gauges["prefill_seconds_per_token"].add_metric(label, fit.prefill_s_per_token)
                    gauges["ttft_overhead_seconds"].add_metric(label, fit.ttft_overhead_s)
                    gauges["tpot_base_seconds"].add_metric(label, fit.tpot_base_s)
                    gauges["tpot_seconds_per_sequence"].add_metric(label, fit.tpot_s_per_seq)
                    load = view.get(key)
                    rate = load.offered_tokens_per_s(now) if load is not None else 0.0
                    offered.add_metric(label, fit.prefill_s_per_token * rate)
                    observed.add_metric([key.label, "ttft"], fit.ttft.observations)
                    observed.add_metric([key.label, "tpot"], fit.tpot.observations)
            yield from gauges.values()
            yield offered
            yield observed
        policy = core.policy
        checked = getattr(policy, "slo_checked", None)
        if checked is not None:
            yield CounterMetricFamily(
                "kvroute_slo_requests",
                "Requests routed with a latency objective (x-slo-ttft-ms, x-slo-tpot-ms or "
                "the model's default)",
                value=checked,
            )
            yield CounterMetricFamily(
                "kvroute_slo_unmet",
                "Requests with a latency objective no engine was predicted to meet (sent to "
                "the least predicted violation)",
                value=getattr(policy, "slo_unmet", 0),
            )


class RouterMetrics:
    """The request-path metrics, in a registry of their own (tests run many routers)."""

    def __init__(self, sources: StateSources | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvroute_requests",
            "Client requests by route, outcome and HTTP status",
            ["route", "outcome", "status"],
            registry=r,
        )
        self.auth_refusals = Counter(
            "kvroute_auth_refusals",
            "Calls refused for their credential, by API, kind and status",
            ["api", "kind", "status"],
            registry=r,
        )
        self.client_gone_at_end = Counter(
            "kvroute_client_gone_at_end",
            "Streamed answers whose client left after the last event, before the stream's "
            "closing bytes (normal: many clients close on data: [DONE]); counted as ok",
            registry=r,
        )
        self.retries = Counter(
            "kvroute_retries",
            "Requests retried on another engine before the first byte",
            ["reason"],
            registry=r,
        )
        self.first_byte_timeouts = Counter(
            "kvroute_first_byte_timeouts",
            "Requests an engine accepted but sent no first byte for in time (504, not retried)",
            ["engine"],
            registry=r,
        )
        self.prefix_match = Histogram(
            "kvroute_prefix_match_ratio",
            "Share of the prompt the chosen engine was expected to hold",
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.routing_seconds = Histogram(
            "kvroute_routing_seconds",
            "Time from receiving a request to forwarding it (parse, tokenize, hash, decide)",
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "kvroute_ttft_seconds",
            "Time to the first streamed byte, as the router sees it",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_seconds = Histogram(
            "kvroute_request_seconds",
            "Time from request to the end of the answer",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.disagg = Counter(
            "kvroute_disagg_decisions",
            "Requests to disaggregated pools by mode (split, local) and reason",
            ["mode", "reason"],
            registry=r,
        )
        self.disagg_links = Counter(
            "kvroute_disagg_links",
            "Split requests by the locality of their prefill-to-decode link (same_node, "
            "same_rack, same_zone, cross_zone; unknown without engine topology)",
            ["locality"],
            registry=r,
        )
        self.handoffs = Counter(
            "kvroute_handoffs",
            "KV handoffs by dialect and outcome (pulled, recomputed, no_params, "
            "prefill_failed, side_channel_refused, failed)",
            ["dialect", "outcome"],
            registry=r,
        )
        self.prefill_leg_seconds = Histogram(
            "kvroute_prefill_leg_seconds",
            "Duration of prefill legs",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_leg_first_byte_seconds = Histogram(
            "kvroute_decode_leg_first_byte_seconds",
            "From sending a decode leg to its first byte (transfer and first token)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transfer_bytes = Counter(
            "kvroute_kv_transfer_bytes_estimated",
            "KV bytes split requests moved, estimated from kv_bytes_per_token",
            registry=r,
        )
        self.loopback_hosts = Counter(
            "kvroute_handoff_loopback_hosts",
            "Prefill answers whose remote_host was a loopback address from a remote engine",
            ["engine"],
            registry=r,
        )
        self.handoff_fields_removed = Counter(
            "kvroute_client_handoff_fields_removed",
            "Router-owned handoff fields (kv_transfer_params, ec_transfer_params, "
            "bootstrap_*) removed from client requests, by field (its dotted path when "
            "nested, e.g. sampling_params.extra_args.kv_transfer_params)",
            ["field"],
            registry=r,
        )
        self.responses_affinity = Counter(
            "kvroute_responses_affinity",
            "Responses API requests with previous_response_id, by whether they went to the "
            "engine holding it: pinned, unknown (no replica recorded the id, or it expired, "
            "and no engine asked holds it), engine_unavailable (its engine is unhealthy, gone, "
            "or no longer serves the model)",
            ["outcome"],
            registry=r,
        )
        self.responses_queries = Counter(
            "kvroute_responses_engine_queries",
            "Response ids no replica remembered, looked for by asking the engines "
            "(responses.ask_engines), by result: found, not_found, not_asked (over "
            "responses.ask_per_second)",
            ["result"],
            registry=r,
        )
        self.abandoned_tokens = Counter(
            "kvroute_handoff_abandoned_tokens",
            "Prompt tokens left pinned on a prefill engine (until its hold timeout) because "
            "the client left before the decode leg pulled them",
            registry=r,
        )
        self.grpc_requests = Counter(
            "kvroute_grpc_requests",
            "gRPC API calls by method and status code",
            ["method", "code"],
            registry=r,
        )
        self.picks = Counter(
            "kvroute_picks",
            "Requests routed for a gateway that forwards them itself, by API (grpc, extproc) "
            "and mode (aggregated, local, split)",
            ["api", "mode"],
            registry=r,
        )
        self.picks_open = Gauge(
            "kvroute_picks_open",
            "Picks holding their engines' load until released (gRPC Pick, ext_proc)",
            registry=r,
        )
        self.extproc_requests = Counter(
            "kvroute_extproc_requests",
            "Requests the ext_proc endpoint picker saw, by outcome (routed, client_error, "
            "rejected, no_engine) and the status sent (200 when routed)",
            ["outcome", "status"],
            registry=r,
        )
        self.state = StateCollector(sources or StateSources())
        r.register(self.state)

    def watch_picks(self, picks: PickLedger) -> None:
        """Export the pick ledger's open count and endings at scrape time."""
        self.picks_open.set_function(lambda: picks.open_count)
        self.state.sources.picks = picks


def _family(
    kind: type[_Family],
    name: str,
    documentation: str,
    labels: list[str],
    samples: Mapping[tuple[str, ...], float],
) -> _Family:
    """A labelled family of ``kind`` holding ``samples`` (label values -> value), in
    label order."""
    family = kind(name, documentation, labels=labels)
    for values, value in sorted(samples.items()):
        family.add_metric(list(values), value)
    return family


def _sync_errors(c: SyncCounters) -> CounterMetricFamily:
    """Failed calls of a decision-stream follower (the replicated mode's, or the shared
    index's for session pins and load changes) and entries it could not decode."""
    errors = CounterMetricFamily(
        "kvroute_replica_sync_errors",
        "Failed calls of decision sharing, by operation",
        labels=["op"],
    )
    errors.add_metric(["publish"], c.publish_errors)
    errors.add_metric(["read"], c.read_errors)
    errors.add_metric(["malformed"], c.malformed)
    return errors
