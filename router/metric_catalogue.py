"""Every metric family the router exports: name, type, help text and label names.

The one list of names (docs/metrics.md documents each; a test checks). A component
builds its families from these entries (``DECISIONS.labelled(...)``,
``INDEX_ERRORS.value(n)``), the request-path instruments are made from them
(``REQUESTS.counter(registry)``), and no module names a ``kvroute_*`` family itself.
Entries follow the sections of docs/metrics.md.

``prometheus_client`` is imported when a family is built, not with this module: the
routing core and the simulator use the components without exporting anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    StateFamily = CounterMetricFamily | GaugeMetricFamily
    """A family read at scrape time."""

Kind = Literal["counter", "gauge", "histogram"]

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


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family: what docs/metrics.md documents about it."""

    name: str
    """Without the ``_total`` a counter is exported with."""
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    """A histogram's upper bounds."""

    @property
    def exported(self) -> str:
        """The name as ``/metrics`` shows it (counters with ``_total``)."""
        return f"{self.name}_total" if self.kind == "counter" else self.name

    def value(self, value: float) -> StateFamily:
        """The family with its one sample, for a family without labels."""
        assert not self.labels, self.name
        return self._state_class()(self.name, self.help, value=value)

    def labelled(self, samples: Iterable[tuple[Sequence[str], float]] = ()) -> StateFamily:
        """The family with ``samples`` (label values, value) in the order given; more
        may be added with ``add_metric``."""
        family = self._state_class()(self.name, self.help, labels=list(self.labels))
        for values, value in samples:
            family.add_metric(list(values), value)
        return family

    def counter(self, registry: CollectorRegistry) -> Counter:
        """The request-path counter in ``registry``."""
        from prometheus_client import Counter

        assert self.kind == "counter", self.name
        return Counter(self.name, self.help, self.labels, registry=registry)

    def gauge(self, registry: CollectorRegistry) -> Gauge:
        """The request-path gauge in ``registry``."""
        from prometheus_client import Gauge

        assert self.kind == "gauge", self.name
        return Gauge(self.name, self.help, self.labels, registry=registry)

    def histogram(self, registry: CollectorRegistry) -> Histogram:
        """The request-path histogram in ``registry``."""
        from prometheus_client import Histogram

        assert self.kind == "histogram", self.name
        return Histogram(self.name, self.help, self.labels, buckets=self.buckets, registry=registry)

    def _state_class(self) -> type[StateFamily]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        assert self.kind != "histogram", self.name
        return CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily


FAMILIES: dict[str, Family] = {}
"""Every family, by name (without ``_total``)."""


def _family(
    name: str, kind: Kind, help: str, *labels: str, buckets: tuple[float, ...] = ()
) -> Family:
    assert name.startswith("kvroute_") and name not in FAMILIES, name
    family = FAMILIES[name] = Family(name, kind, help, labels, buckets)
    return family


# ---------------------------------------------------------------------------- requests

REQUESTS = _family(
    "kvroute_requests",
    "counter",
    "Client requests by route, outcome and HTTP status",
    "route",
    "outcome",
    "status",
)
CLIENT_GONE_AT_END = _family(
    "kvroute_client_gone_at_end",
    "counter",
    "Streamed answers whose client left after the last event, before the stream's "
    "closing bytes (normal: many clients close on data: [DONE]); counted as ok",
)
AUTH_REFUSALS = _family(
    "kvroute_auth_refusals",
    "counter",
    "Calls refused for their credential, by API, kind and status",
    "api",
    "kind",
    "status",
)
RETRIES = _family(
    "kvroute_retries",
    "counter",
    "Requests retried on another engine before the first byte",
    "reason",
)
FIRST_BYTE_TIMEOUTS = _family(
    "kvroute_first_byte_timeouts",
    "counter",
    "Requests an engine accepted but sent no first byte for in time (504, not retried)",
    "engine",
)
ROUTING_SECONDS = _family(
    "kvroute_routing_seconds",
    "histogram",
    "Time from receiving a request to forwarding it (parse, tokenize, hash, decide)",
    buckets=OVERHEAD_BUCKETS,
)
TTFT_SECONDS = _family(
    "kvroute_ttft_seconds",
    "histogram",
    "Time to the first streamed byte, as the router sees it",
    buckets=LATENCY_BUCKETS,
)
REQUEST_SECONDS = _family(
    "kvroute_request_seconds",
    "histogram",
    "Time from request to the end of the answer",
    buckets=LATENCY_BUCKETS,
)
PREFIX_MATCH_RATIO = _family(
    "kvroute_prefix_match_ratio",
    "histogram",
    "Share of the prompt the chosen engine was expected to hold",
    buckets=RATIO_BUCKETS,
)
INFLIGHT_REQUESTS = _family(
    "kvroute_inflight_requests", "gauge", "Requests in flight through this router"
)
ADMISSION_WAITING = _family(
    "kvroute_admission_waiting",
    "gauge",
    "Requests waiting in the admission queue for a slot or an engine with room",
)
ADMISSION_REJECTED = _family(
    "kvroute_admission_rejected",
    "counter",
    "Requests answered 429 by admission control, by reason",
    "reason",
)
POOL_SATURATION = _family(
    "kvroute_pool_saturation",
    "gauge",
    "How full each model's pool is, 0 to 1 (flow control sheds at flow.saturation.shed_at)",
    "model",
)
FLOW_WAITING = _family(
    "kvroute_flow_waiting",
    "gauge",
    "Requests waiting in the admission queue, by priority band and tenant",
    "band",
    "tenant",
)
FLOW_ADMITTED = _family(
    "kvroute_flow_admitted",
    "counter",
    "Requests flow control admitted, by priority band",
    "band",
)
FLOW_WAIT_SECONDS = _family(
    "kvroute_flow_wait_seconds",
    "counter",
    "Seconds admitted requests waited in the admission queue, by priority band",
    "band",
)
FLOW_REFUSED = _family(
    "kvroute_flow_refused",
    "counter",
    "Requests flow control refused, by priority band and reason (shed, rpm, tpm, "
    "band_full, timeout)",
    "band",
    "reason",
)
FLOW_PREFILL_ISOLATION = _family(
    "kvroute_flow_prefill_isolation",
    "counter",
    "Prefill isolation (flow.prefill_isolation): decisions that left out an "
    "engine prefilling an outranking request (avoided), decisions kept off "
    "engines reserved for outranking requests (reserved), requests that waited "
    "for such prefills to end (waited), requests routed beside them (overridden)",
    "outcome",
)
FLOW_PREFILL_ISOLATION_WAIT_SECONDS = _family(
    "kvroute_flow_prefill_isolation_wait_seconds",
    "counter",
    "Seconds requests waited for outranking prefills to end",
)
RATE_LIMIT_FALLBACKS = _family(
    "kvroute_rate_limit_fallbacks",
    "counter",
    "Rate-limit decisions made by local buckets because Redis did not answer",
)
ADMISSION_INFLIGHT = _family(
    "kvroute_admission_inflight",
    "gauge",
    "Requests holding one of the limits.max_inflight slots",
)
ADMISSION_READING_BODY = _family(
    "kvroute_admission_reading_body",
    "gauge",
    "Requests holding a slot while their body is still being read",
)
HTTP_CONNECTIONS = _family(
    "kvroute_http_connections", "gauge", "Client connections open on the HTTP listener"
)
HTTP_CONNECTIONS_REFUSED = _family(
    "kvroute_http_connections_refused",
    "counter",
    "Client connections closed on arrival: server.max_connections were open",
)
HTTP_TIMEOUTS = _family(
    "kvroute_http_timeouts",
    "counter",
    "Client connections closed because a request's head or body came too slowly",
    "phase",
)
HTTP_MALFORMED_REQUESTS = _family(
    "kvroute_http_malformed_requests",
    "counter",
    "Requests answered 400 before any handler: unparseable, or an Expect not UTF-8",
)

# --------------------------------------------------------------------------- decisions

DECISIONS = _family(
    "kvroute_decisions",
    "counter",
    "Routing decisions by policy and reason",
    "policy",
    "reason",
)
INDEX_ERRORS = _family(
    "kvroute_index_errors", "counter", "Index calls that failed or ran over budget"
)
SLO_REQUESTS = _family(
    "kvroute_slo_requests",
    "counter",
    "Requests routed with a latency objective (x-slo-ttft-ms, x-slo-tpot-ms or "
    "the model's default)",
)
SLO_UNMET = _family(
    "kvroute_slo_unmet",
    "counter",
    "Requests with a latency objective no engine was predicted to meet (sent to "
    "the least predicted violation)",
)
SESSION_PINS_PUBLISHED = _family(
    "kvroute_session_pins_published",
    "counter",
    "Session pins (the latency policy's affinity) this replica shared through Redis",
)
SESSION_PINS_LEARNT = _family(
    "kvroute_session_pins_learnt",
    "counter",
    "Session pins other replicas shared that this replica learnt",
)

# ----------------------------------------------------------------------------- engines

ENGINE_HEALTHY = _family(
    "kvroute_engine_healthy", "gauge", "1 if the engine takes requests", "engine"
)
ENGINE_EJECTIONS = _family(
    "kvroute_engine_ejections", "counter", "Times the engine was ejected", "engine"
)
ENGINE_REFUSED = _family(
    "kvroute_engine_refused",
    "gauge",
    "1 if the engine is refused (e.g. its block size differs from its pool's)",
    "engine",
)
ENGINE_INFLIGHT_REQUESTS = _family(
    "kvroute_engine_inflight_requests",
    "gauge",
    "Requests this router has in flight there",
    "engine",
)
ENGINE_QUEUED_PREFILL_TOKENS = _family(
    "kvroute_engine_queued_prefill_tokens",
    "gauge",
    "Prompt tokens this router sent there whose first token has not come back",
    "engine",
)
ENGINE_PEER_INFLIGHT_REQUESTS = _family(
    "kvroute_engine_peer_inflight_requests",
    "gauge",
    "Requests other router replicas have in flight there (shared through Redis)",
    "engine",
)
ENGINE_PEER_QUEUED_PREFILL_TOKENS = _family(
    "kvroute_engine_peer_queued_prefill_tokens",
    "gauge",
    "Prompt tokens other router replicas sent there whose first token has not come back",
    "engine",
)
ENGINE_PREFILL_SECONDS_PER_TOKEN = _family(
    "kvroute_engine_prefill_seconds_per_token",
    "gauge",
    "Fitted prefill time per uncached prompt token",
    "engine",
)
ENGINE_PREFILL_UTILIZATION = _family(
    "kvroute_engine_prefill_utilization",
    "gauge",
    "Prefill seconds offered to the engine per second lately (its recent uncached "
    "prompt tokens per second, all replicas', times its fitted prefill time per "
    "token): the busy term of the default policy",
    "engine",
)
ENGINE_TTFT_OVERHEAD_SECONDS = _family(
    "kvroute_engine_ttft_overhead_seconds",
    "gauge",
    "Fitted time to a first token, nothing to prefill",
    "engine",
)
ENGINE_TPOT_BASE_SECONDS = _family(
    "kvroute_engine_tpot_base_seconds",
    "gauge",
    "Fitted time per output token of a lone sequence",
    "engine",
)
ENGINE_TPOT_SECONDS_PER_SEQUENCE = _family(
    "kvroute_engine_tpot_seconds_per_sequence",
    "gauge",
    "Fitted time each other decoding sequence adds per output token",
    "engine",
)
ENGINE_LATENCY_OBSERVATIONS = _family(
    "kvroute_engine_latency_observations",
    "counter",
    "First tokens (ttft) and finished streams (tpot) the latency model learnt from",
    "engine",
    "kind",
)

# ------------------------------------------------------------------ index and KV events

INDEX_BLOCKS = _family("kvroute_index_blocks", "gauge", "Distinct block keys in the index")
INDEX_ENTRIES = _family(
    "kvroute_index_entries", "gauge", "(block, engine, tier) records in the index"
)
INDEX_BYTES = _family(
    "kvroute_index_bytes", "gauge", "Bytes the in-memory index's compiled tables hold"
)
INDEX_EVICTIONS = _family(
    "kvroute_index_evictions",
    "counter",
    "Index records evicted for room (index.max_entries_per_engine, index.max_entries), by cause",
    "reason",
)
INDEX_AVAILABLE = _family(
    "kvroute_index_available",
    "gauge",
    "1 while the KV-block index answers (Redis reachable within budget)",
)
INDEX_OUTAGES = _family(
    "kvroute_index_outages",
    "counter",
    "Times Redis became unreachable or slower than the budget",
)
INDEX_SLOW_CALLS = _family(
    "kvroute_index_slow_calls",
    "counter",
    "Redis calls over the budget that did not mark Redis unavailable",
)
INDEX_FALLBACKS = _family(
    "kvroute_index_fallbacks",
    "counter",
    "Lookups answered from this router's shadow of recent decisions",
)
INDEX_UNWRITTEN_RECORDS = _family(
    "kvroute_index_unwritten_records",
    "counter",
    "Decision records that did not reach Redis when made",
)
INDEX_REPLAYED_RECORDS = _family(
    "kvroute_index_replayed_records",
    "counter",
    "Decision records written to Redis from the shadow after an outage",
)
LOAD_PEERS = _family(
    "kvroute_load_peers",
    "gauge",
    "Other router replicas whose in-flight load this router counts",
)
LOAD_CHANGES_SENT = _family(
    "kvroute_load_changes_sent",
    "counter",
    "Engines' in-flight figures this replica sent to its peers on the decision "
    "stream between exchanges (index.redis.load_push)",
)
LOAD_CHANGES_APPLIED = _family(
    "kvroute_load_changes_applied",
    "counter",
    "Peers' in-flight figures from the decision stream newer than what this replica had",
)
REPLICA_SYNC_PUBLISHED = _family(
    "kvroute_replica_sync_published",
    "counter",
    "This replica's routing decisions appended to the shared decision stream",
)
REPLICA_SYNC_ENTRIES = _family(
    "kvroute_replica_sync_entries",
    "counter",
    "Entries this replica appended to the decision stream (decisions batched)",
)
REPLICA_SYNC_APPLIED = _family(
    "kvroute_replica_sync_applied",
    "counter",
    "Other replicas' decisions recorded in this replica's index",
)
REPLICA_SYNC_EXPIRED = _family(
    "kvroute_replica_sync_expired",
    "counter",
    "Other replicas' decisions read after their records' life had ended",
)
REPLICA_SYNC_DROPPED = _family(
    "kvroute_replica_sync_dropped",
    "counter",
    "This replica's decisions never published, by reason",
    "reason",
)
REPLICA_SYNC_ERRORS = _family(
    "kvroute_replica_sync_errors",
    "counter",
    "Failed calls of decision sharing, by operation",
    "op",
)
REPLICA_SYNC_PENDING = _family(
    "kvroute_replica_sync_pending",
    "gauge",
    "This replica's decisions waiting to be published",
)
REPLICA_SYNC_DELAY_SECONDS = _family(
    "kvroute_replica_sync_delay_seconds",
    "gauge",
    "From decision to record in this index, for the last peer decision applied",
)
REPLICA_SNAPSHOTS_WRITTEN = _family(
    "kvroute_replica_snapshots_written",
    "counter",
    "Engine stream snapshots this replica wrote to Redis (while it holds the lease)",
)
KV_EVENTS = _family("kvroute_kv_events", "counter", "KV events applied, by type", "type")
KV_EVENTS_SKIPPED = _family(
    "kvroute_kv_events_skipped", "counter", "KV events not applied, by reason", "reason"
)
KV_EVENT_HASHES_FORGOTTEN = _family(
    "kvroute_kv_event_hashes_forgotten",
    "counter",
    "Engine block hashes dropped from full per-stream maps (index.max_entries_per_engine)",
)
KV_EVENT_UNKNOWN_FIELDS = _family(
    "kvroute_kv_event_unknown_fields",
    "counter",
    "Fields of applied KV events this version does not read (ignored)",
)
KV_EVENT_BATCHES = _family("kvroute_kv_event_batches", "counter", "KV-event batches applied")
KV_EVENTS_BLOCK_SIZE_MISMATCH = _family(
    "kvroute_kv_events_block_size_mismatch",
    "counter",
    "BlockStored events dropped because their block size is not the engine's",
    "engine",
)
KV_EVENT_GAPS = _family(
    "kvroute_kv_event_gaps", "counter", "Sequence gaps seen in KV-event streams"
)
KV_EVENT_REPLAYS = _family(
    "kvroute_kv_event_replays", "counter", "Replay requests by outcome", "outcome"
)
KV_EVENT_RESTARTS = _family(
    "kvroute_kv_event_restarts",
    "counter",
    "Engine restarts detected from sequence numbers",
)
KV_EVENT_GARBAGE = _family(
    "kvroute_kv_event_garbage", "counter", "Undecodable KV-event frames dropped"
)
KV_EVENTS_ADDRESS_MISMATCH = _family(
    "kvroute_kv_events_address_mismatch",
    "counter",
    "Bound-socket messages dropped: their topic names an engine at another "
    "address than the publisher's",
)
KV_EVENT_PUBLISHERS_REFUSED = _family(
    "kvroute_kv_event_publishers_refused",
    "counter",
    "Bound-socket publisher handshakes refused for a CURVE key not admitted",
)
KV_EVENT_LAG_SECONDS = _family(
    "kvroute_kv_event_lag_seconds",
    "gauge",
    "Publish-to-apply delay of the last batch",
    "engine",
)
KV_EVENT_RESNAPSHOTS = _family(
    "kvroute_kv_event_resnapshots",
    "counter",
    "Engine streams rewritten into Redis from their state after writes were lost",
)

# ------------------------------------------------------------ disaggregated prefill/decode

DISAGG_DECISIONS = _family(
    "kvroute_disagg_decisions",
    "counter",
    "Requests to disaggregated pools by mode (split, local) and reason",
    "mode",
    "reason",
)
DISAGG_LINKS = _family(
    "kvroute_disagg_links",
    "counter",
    "Split requests by the locality of their prefill-to-decode link (same_node, "
    "same_rack, same_zone, cross_zone; unknown without engine topology)",
    "locality",
)
HANDOFFS = _family(
    "kvroute_handoffs",
    "counter",
    "KV handoffs by dialect and outcome (pulled, recomputed, no_params, "
    "prefill_failed, side_channel_refused, failed)",
    "dialect",
    "outcome",
)
PREFILL_LEG_SECONDS = _family(
    "kvroute_prefill_leg_seconds",
    "histogram",
    "Duration of prefill legs",
    buckets=LATENCY_BUCKETS,
)
DECODE_LEG_FIRST_BYTE_SECONDS = _family(
    "kvroute_decode_leg_first_byte_seconds",
    "histogram",
    "From sending a decode leg to its first byte (transfer and first token)",
    buckets=LATENCY_BUCKETS,
)
KV_TRANSFER_BYTES_ESTIMATED = _family(
    "kvroute_kv_transfer_bytes_estimated",
    "counter",
    "KV bytes split requests moved, estimated from kv_bytes_per_token",
)
HANDOFF_LOOPBACK_HOSTS = _family(
    "kvroute_handoff_loopback_hosts",
    "counter",
    "Prefill answers whose remote_host was a loopback address from a remote engine",
    "engine",
)
RESPONSES_AFFINITY = _family(
    "kvroute_responses_affinity",
    "counter",
    "Responses API requests with previous_response_id, by whether they went to the "
    "engine holding it: pinned, unknown (no replica recorded the id, or it expired, "
    "and no engine asked holds it), engine_unavailable (its engine is unhealthy, gone, "
    "or no longer serves the model)",
    "outcome",
)
RESPONSES_ENGINE_QUERIES = _family(
    "kvroute_responses_engine_queries",
    "counter",
    "Response ids no replica remembered, looked for by asking the engines "
    "(responses.ask_engines), by result: found, not_found, not_asked (over "
    "responses.ask_per_second)",
    "result",
)
CLIENT_HANDOFF_FIELDS_REMOVED = _family(
    "kvroute_client_handoff_fields_removed",
    "counter",
    "Router-owned handoff fields (kv_transfer_params, ec_transfer_params, "
    "bootstrap_*) removed from client requests, by field (its dotted path when "
    "nested, e.g. sampling_params.extra_args.kv_transfer_params)",
    "field",
)
HANDOFF_ABANDONED_TOKENS = _family(
    "kvroute_handoff_abandoned_tokens",
    "counter",
    "Prompt tokens left pinned on a prefill engine (until its hold timeout) because "
    "the client left before the decode leg pulled them",
)

# ------------------------------------------------------------------ gRPC API and ext_proc

GRPC_REQUESTS = _family(
    "kvroute_grpc_requests",
    "counter",
    "gRPC API calls by method and status code",
    "method",
    "code",
)
PICKS = _family(
    "kvroute_picks",
    "counter",
    "Requests routed for a gateway that forwards them itself, by API (grpc, extproc) "
    "and mode (aggregated, local, split)",
    "api",
    "mode",
)
PICKS_OPEN = _family(
    "kvroute_picks_open",
    "gauge",
    "Picks holding their engines' load until released (gRPC Pick, ext_proc)",
)
PICKS_ENDED = _family(
    "kvroute_picks_ended",
    "counter",
    "Picks whose load was released, by how (released, expired, stream_end)",
    "how",
)
EXTPROC_REQUESTS = _family(
    "kvroute_extproc_requests",
    "counter",
    "Requests the ext_proc endpoint picker saw, by outcome (routed, client_error, "
    "rejected, no_engine) and the status sent (200 when routed)",
    "outcome",
    "status",
)

# -------------------------------------------------------------------------- tokenizers

TOKENIZER_MODE = _family(
    "kvroute_tokenizer_mode",
    "gauge",
    "1 for the tokenizer mode each model's pool uses",
    "model",
    "mode",
)
TOKENIZER_MISMATCHES = _family(
    "kvroute_tokenizer_mismatches",
    "counter",
    "Answers whose prompt-token count differed from the router's",
    "model",
)
TOKENIZER_SOURCE = _family(
    "kvroute_tokenizer_source",
    "gauge",
    "1 for where each model's pool got its tokenizer (tokenizer.mode auto: "
    "engine, model_dirs, hf_cache, hub, probe, none, pending, guard; configured)",
    "model",
    "source",
)
TOKENIZER_CHARS_PER_TOKEN = _family(
    "kvroute_tokenizer_chars_per_token",
    "gauge",
    "Characters per pseudo-token of each model's pool in approximate mode",
    "model",
)

# ----------------------------------------------------------------------------- process

BUILD_INFO = _family("kvroute_build_info", "gauge", "kvroute version", "version")
NATIVE_HELPER = _family(
    "kvroute_native_helper",
    "gauge",
    "1 when block keys are computed by the compiled helper, 0 on the pure-Python path",
)
CONFIG_RELOADS = _family(
    "kvroute_config_reloads",
    "counter",
    "Configuration reloads (SIGHUP or a changed file) by outcome",
    "outcome",
)

# ---------------------------------------------------------------- Kubernetes discovery

DISCOVERY_ENGINES = _family(
    "kvroute_discovery_engines",
    "gauge",
    "Engines registered from Kubernetes pods, by pod readiness",
    "state",
)
DISCOVERY_EVENTS = _family(
    "kvroute_discovery_events", "counter", "Pod watch events by type", "type"
)
DISCOVERY_LISTS = _family(
    "kvroute_discovery_lists", "counter", "Full pod lists (start-up and relists)"
)
DISCOVERY_EXPIRED = _family(
    "kvroute_discovery_expired",
    "counter",
    "Watches whose resourceVersion had expired (410 Gone): relisted",
)
DISCOVERY_ERRORS = _family(
    "kvroute_discovery_errors",
    "counter",
    "Failed or broken pod list and watch requests (retried after a backoff)",
)
