"""kvroute's configuration: one typed object, loaded from YAML and the environment.

Precedence, lowest first: defaults, the YAML file (``--config``), environment variables
``KVROUTE_<SECTION>__<KEY>`` (``__`` separates nesting levels; values are parsed as
YAML scalars, so ``KVROUTE_POLICY__PREFILL_WEIGHT=2`` is a number), then command-line
flags. Validation happens once at start-up and every error names its field.

A plugin's own section lives beside the plugin and is nested here: the ``policy``
section with the policy registry in router/policy/registry.py, each policy's parameters
in router/policy/<name>_config.py, each index backend's settings in
router/index/<name>_config.py, flow control's in router/flow/config.py, Kubernetes
discovery's in router/fleet/k8s_config.py. Import a section's own names from its module.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core.core_schema import ValidationInfo

from router.config_section import Section
from router.fleet.k8s_config import KubernetesDiscoveryConfig
from router.flow.config import FlowConfig
from router.handoff import registry as handoff_registry
from router.index.redis_config import RedisIndexConfig
from router.index.replicated_config import ReplicatedIndexConfig
from router.media import DEFAULT_MM_PLACEHOLDER_TOKENS
from router.policy.registry import PolicyConfig

ENV_PREFIX = "KVROUTE_"
PROCESS_SWITCHES = frozenset({"KVROUTE_PURE_PYTHON"})
"""Environment variables with the prefix that are not configuration keys: switches read
by the process itself (``KVROUTE_PURE_PYTHON=1``: the pure-Python paths instead of the
compiled helper, router/hashing.py)."""

# Kubernetes gives every pod of a namespace "service links" for each Service in it
# (unless the pod sets enableServiceLinks: false): a Service named kvroute, or
# kvroute-anything, gives KVROUTE_SERVICE_HOST=10.0.0.7, KVROUTE_PORT=tcp://10.0.0.7:8000
# and so on. They carry the prefix but are no configuration, so they are recognised by
# their exact name shape and value and left alone; anything else with the prefix is a
# configuration key (a misspelt one is still refused, naming the variable).
_SERVICE = r"KVROUTE(?:_[A-Z0-9_]*[A-Z0-9])?"
_LINK = r"(?P<port>[0-9]+)_(?P<proto>TCP|UDP|SCTP)"
_LINK_URL = re.compile(
    r"(?P<proto>tcp|udp|sctp)://(?:\[(?P<ip6>[0-9a-fA-F:.]+)\]|(?P<ip>[0-9.]+)):(?P<port>[0-9]+)"
)
_SERVICE_LINKS = (
    (re.compile(rf"{_SERVICE}_SERVICE_HOST"), "ip"),
    (re.compile(rf"{_SERVICE}_SERVICE_PORT(?:_[A-Z0-9_]+)?"), "port"),
    (re.compile(rf"{_SERVICE}_PORT"), "url"),
    (re.compile(rf"{_SERVICE}_PORT_{_LINK}"), "url"),
    (re.compile(rf"{_SERVICE}_PORT_{_LINK}_PROTO"), "proto"),
    (re.compile(rf"{_SERVICE}_PORT_{_LINK}_PORT"), "port"),
    (re.compile(rf"{_SERVICE}_PORT_{_LINK}_ADDR"), "ip"),
)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit() and 0 < int(text) < 65536


def is_service_link(name: str, value: str) -> bool:
    """Whether ``name=value`` is a Kubernetes service-link variable of a Service whose
    name starts with ``kvroute`` (``KVROUTE_SERVICE_HOST``, ``KVROUTE_PORT_8000_TCP``...),
    by the shapes the kubelet writes them in: the name's suffix and a value to match."""
    for shape, kind in _SERVICE_LINKS:
        match = shape.fullmatch(name)
        if match is None:
            continue
        named = match.groupdict()
        if kind == "ip":
            ok = _is_ip(value)
        elif kind == "port":
            ok = _is_port(value) and value == named.get("port", value)
        elif kind == "proto":
            ok = value == named["proto"].lower()
        else:
            url = _LINK_URL.fullmatch(value)
            ok = (
                url is not None
                and _is_ip(url["ip"] or url["ip6"])
                and _is_port(url["port"])
                and url["proto"] == (named.get("proto") or url["proto"]).lower()
                and url["port"] == named.get("port", url["port"])
            )
        if ok:
            return True
    return False


_DIALECTS = " or ".join(f"`{name}`" for name in handoff_registry.names())
"""The built-in handoff dialects, for the reference."""


def _dialect(value: str | None) -> str | None:
    """A handoff dialect's name, if :mod:`router.handoff.registry` knows it."""
    if value is not None and value not in handoff_registry.names():
        known = ", ".join(handoff_registry.names())
        raise ValueError(f"unknown handoff dialect {value!r} (registered: {known})")
    return value


class IndexConfig(Section):
    """Where the KV-block index lives."""

    backend: Literal["memory", "redis", "replicated"] = Field(
        "memory",
        description="`memory` (embedded, default), `redis` (one index shared by replicas in "
        "Redis) or `replicated` (an in-memory index per replica, decisions shared through "
        "Redis: `index.replicated`). docs/redis-schema.md says when to use which.",
    )
    max_entries: int = Field(
        0,
        ge=0,
        description="In-memory index: at most this many (block, engine, tier) records in "
        "all; when full, the engine holding the most loses its least recently stored blocks "
        "(`kvroute_index_evictions_total`), down to seven eighths of this. 0: no limit. A "
        "record costs about 60 bytes of the router's memory with its event stream's "
        "engine-hash map (about 300 without the compiled helper; docs/operations.md sizes "
        "it).",
    )
    max_entries_per_engine: int = Field(
        1_048_576,
        ge=0,
        description="At most this many records of one engine (one DP rank) in one tier: "
        "the in-memory index holds no more, and each event stream's engine-hash map (of "
        "routers and `kvroute indexer`, whatever the backend) keeps no more hashes, the "
        "blocks of those it forgets leaving the index (memory or Redis) with them; past it "
        "the engine's least recently stored blocks go, down to seven eighths. 0: no limit. "
        "The default is above any GPU's block count and bounds a runaway engine.",
    )
    shadow_window_s: float = Field(
        60.0,
        gt=0,
        description="Shared backends (`redis`): how long this router remembers its own "
        "routing decisions locally, to route on them while the shared index is unavailable "
        "or over budget.",
    )
    shadow_max_keys: int = Field(
        1_000_000,
        gt=0,
        description="Shared backends (`redis`): at most this many block keys of remembered "
        "decisions (about 50 bytes each); past it the oldest decisions go first.",
    )
    redis: RedisIndexConfig = Field(default_factory=RedisIndexConfig)
    replicated: ReplicatedIndexConfig = Field(default_factory=ReplicatedIndexConfig)

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        # Built directly or from a tree load_config did not see (Config.model_validate):
        # the old names still work (load_config reports them with their sources).
        if not isinstance(data, Mapping):
            return data
        try:
            return move_renamed(data, "index")[0]
        except RenamedKeyConflict as exc:
            raise ValueError(str(exc)) from None


RENAMED_KEYS: dict[str, str] = {
    f"index.{key}": f"index.redis.{key}"
    for key in (
        "url",
        "namespace",
        "budget_ms",
        "slow_calls_to_outage",
        "share_load",
        "load_interval_s",
        "load_ttl_s",
    )
}
"""Deprecated key -> the key that replaced it (dotted paths). The old keys keep working:
their values move to the new ones, :attr:`Config.deprecations` says so (``kvroute
serve`` and ``kvroute indexer`` log it at start, ``kvroute config check`` prints it),
and setting both to different values is an error."""


class RenamedKeyConflict(ValueError):
    """A deprecated key and the key that replaced it are both set, to different values."""

    def __init__(self, old: str, new: str, old_from: str = "", new_from: str = "") -> None:
        super().__init__(
            f"{old}{old_from} and {new}{new_from} are both set, to different values ({old} "
            f"is the deprecated name of {new}): set only {new}"
        )
        self.old = old
        self.new = new


def _lookup(tree: Mapping[str, Any], path: list[str]) -> tuple[bool, Any]:
    node: Any = tree
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def move_renamed(
    tree: Mapping[str, Any], under: str = ""
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """``tree`` (the configuration, or its section at dotted path ``under``) with every
    deprecated key of :data:`RENAMED_KEYS` moved to its new name, and the (old, new)
    pairs moved. Raises :class:`RenamedKeyConflict` when both are set, differently."""
    prefix = f"{under}." if under else ""
    out = _copy_tree(tree)
    moved: list[tuple[str, str]] = []
    for old, new in RENAMED_KEYS.items():
        if not (old.startswith(prefix) and new.startswith(prefix)):
            continue
        old_path = old[len(prefix) :].split(".")
        new_path = new[len(prefix) :].split(".")
        found, value = _lookup(out, old_path)
        _, parent = _lookup(out, old_path[:-1])
        if not found or not isinstance(parent, dict):
            continue
        has_new, current = _lookup(out, new_path)
        if has_new and current != value:
            raise RenamedKeyConflict(old, new)
        _, target = _lookup(out, new_path[:-1])
        if target is not None and not isinstance(target, dict):
            continue  # the new section is not a mapping: validation names it
        del parent[old_path[-1]]
        _set_path(out, new_path, value)
        moved.append((old, new))
    return out, moved


def _copy_tree(tree: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the mappings of a tree (other values are shared, not copied)."""
    return {k: _copy_tree(v) if isinstance(v, Mapping) else v for k, v in tree.items()}


class ServerConfig(Section):
    """The router's own HTTP listener."""

    host: str = Field("127.0.0.1", description="Address to bind (0.0.0.0 for all).")
    port: int = Field(8000, ge=0, le=65535, description="Port to bind; 0 picks a free one.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log verbosity; debug logs every decision's full reason."
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="`text`: one human-readable line per record; `json`: one JSON object "
        "per line (`ts`, `level`, `logger`, `msg` and the record's fields, e.g. `request_id`).",
    )
    access_log: bool = Field(
        False,
        description="Log one line per request at info level (request id, status, duration, "
        "chosen engines, decision reason); off, the line is logged at debug level.",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM: how long in-flight requests (streams included) may run "
        "after the router stops accepting connections; the rest are cancelled, then it exits.",
    )
    reload_poll_s: float = Field(
        0.0,
        ge=0,
        description="Re-read `--config` this often and reload when its content changed "
        "(0: only on SIGHUP). For ConfigMaps mounted as files.",
    )
    max_connections: int = Field(
        8192,
        gt=0,
        description="Client connections open at once; one more is closed as it arrives "
        "(`kvroute_http_connections_refused_total`). The router raises its open-file limit "
        "to about twice this (one engine connection per client connection) and warns if "
        "the hard limit is lower.",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A request's line and headers must arrive within this long of their "
        "first byte; else the connection is closed.",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A request's body must arrive within this long of its headers; else "
        "the client gets 408, the connection is closed and the request's in-flight slot "
        "freed. Keep it above `limits.admission_timeout_s` (bodies wait unread in the queue).",
    )
    keepalive_timeout_s: float = Field(
        75.0,
        gt=0,
        description="A client connection with no request for this long (since it opened "
        "or since its last answer) is closed. Keep it above the idle timeout of a load "
        "balancer in front (60 s on most), so that the balancer closes first.",
    )


class GrpcConfig(Section):
    """The gRPC API (kvroute.v1 Router and Admin, health, reflection; docs/grpc.md)."""

    host: str | None = Field(None, description="Address to bind (default: `server.host`).")
    port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Port of the gRPC listener (`--grpc-port`); 0 picks a free one; "
        "unset: no gRPC listener.",
    )
    pick_ttl_s: float = Field(
        600.0,
        gt=0,
        description="A Pick that is never released holds its engines' load this long, "
        "then expires (longer than your longest request).",
    )


class ExtProcConfig(Section):
    """The Envoy ext_proc endpoint picker (Gateway API Inference Extension; docs/grpc.md)."""

    host: str | None = Field(None, description="Address to bind (default: `server.host`).")
    port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Port of the ext_proc listener (`--extproc-port`); 0 picks a free "
        "one; unset: no ext_proc listener.",
    )
    fallbacks: int = Field(
        0,
        ge=0,
        le=16,
        description="Endpoints listed after the chosen one in "
        "`x-gateway-destination-endpoint`, cheapest first, for the gateway to retry on.",
    )


class EventEndpoints(Section):
    """Where an engine publishes KV events (vLLM's ``--kv-events-config``)."""

    endpoint: str = Field(description="The engine's ZMQ PUB endpoint, e.g. tcp://10.0.0.5:5557.")
    replay_endpoint: str | None = Field(None, description="Its replay ROUTER endpoint.")
    topic: str = Field("", description="Topic prefix to subscribe to.")


class TopologyConfig(Section):
    """Where an engine runs, for the cost of moving KV between engines
    (docs/disaggregation.md, "Topology"). Free-form names; unset parts are unknown."""

    node: str | None = Field(None, description="The machine (Kubernetes node) the engine runs on.")
    rack: str | None = Field(
        None, description="The rack (or NVLink / RDMA domain) of that machine."
    )
    zone: str | None = Field(
        None, description="The zone (`topology.kubernetes.io/zone`) of that machine."
    )


class EngineConfig(Section):
    """One engine (inference server) the router may send requests to."""

    bootstrap_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="SGLang prefill engines: the bootstrap port (default: /server_info).",
    )
    url: str = Field(
        description="The engine server's root URL, e.g. http://10.0.0.5:8000: no path "
        "(not the OpenAI base URL http://10.0.0.5:8000/v1), the router adds /v1/..., "
        "/health and the rest itself."
    )
    role: Literal["both", "prefill", "decode"] = Field(
        "both", description="What the engine does in disaggregated serving."
    )
    models: list[str] = Field(
        default_factory=list, description="Models served; empty means ask its /v1/models."
    )
    dp_size: int = Field(1, ge=1, description="Data-parallel ranks behind this URL.")
    kv_events: Literal["auto", "none"] | EventEndpoints = Field(
        "auto",
        description="`auto`: read endpoints from the engine's /server_info (the emulator) "
        "or /kv_event_sources (vLLM 0.32), else by `events.port`'s convention, else track "
        "it from decisions; `none`: never subscribe; or explicit endpoints.",
    )
    topology: TopologyConfig = Field(
        default_factory=TopologyConfig,
        description="Where the engine runs (node, rack, zone): prefill/decode pairs are "
        "priced by the link between them (`disaggregation.links`).",
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise ValueError("engine url must look like http://host:port")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            # The OpenAI base-URL habit (.../v1) would be accepted and never become ready:
            # every call the router makes is this URL + /v1/..., /health, /metrics.
            root = f"{parts.scheme}://{parts.netloc}"
            raise ValueError(
                f"engine url {url} has a path: give the engine server's root, {root} "
                "(the router adds /v1/..., /health and the rest itself)"
            )
        return url.rstrip("/")


class HealthConfig(Section):
    """Active probes and passive ejection of engines."""

    interval_s: float = Field(2.0, gt=0, description="Seconds between /health probes.")
    timeout_s: float = Field(1.0, gt=0, description="A probe slower than this fails.")
    eject_after_failures: int = Field(
        3,
        ge=1,
        description="Consecutive failures (probes or requests) that eject an engine; a "
        "4xx answer (429 included) is the request's or a busy engine's, not a failure.",
    )
    backoff_initial_s: float = Field(1.0, gt=0, description="First ejection's length.")
    backoff_max_s: float = Field(30.0, gt=0, description="Longest ejection (doubles up to it).")
    models_refresh_s: float = Field(
        30.0, gt=0, description="Seconds between re-reads of /v1/models (LoRA adapters change)."
    )


class ScrapeConfig(Section):
    """Background reads of the engines' /metrics (never on the request path)."""

    interval_s: float = Field(1.0, gt=0, description="Seconds between /metrics scrapes.")
    timeout_s: float = Field(1.0, gt=0, description="A scrape slower than this is skipped.")


class ProxyConfig(Section):
    """Forwarding to engines."""

    connect_timeout_s: float = Field(2.0, gt=0, description="TCP connect to an engine.")
    first_byte_timeout_s: float = Field(
        120.0, gt=0, description="From sending to the engine's first byte (queueing + prefill)."
    )
    idle_timeout_s: float = Field(60.0, gt=0, description="Longest silence inside a response.")
    retries: int = Field(
        1, ge=0, le=3, description="Retries on another engine before the first byte is relayed."
    )
    keepalive_s: float = Field(
        4.0,
        gt=0,
        description="Idle connections to engines older than this are closed, not reused "
        "(keep it under the engines' own keep-alive: uvicorn, and so vLLM, use 5 s).",
    )
    ca_file: Path | None = Field(
        None,
        description="PEM CA bundle that signs engines' certificates (engines with https "
        "URLs); default: the system's trust store.",
    )
    client_cert_file: Path | None = Field(
        None, description="PEM certificate the router presents to https engines (mutual TLS)."
    )
    client_key_file: Path | None = Field(None, description="PEM key of `client_cert_file`.")
    verify_tls: bool = Field(
        True, description="Verify https engines' certificates and host names (keep it on)."
    )


class LimitsConfig(Section):
    """Bounds on what the router accepts."""

    max_body_bytes: int = Field(16 * 2**20, gt=0, description="Largest request body (413).")
    max_json_depth: int = Field(
        32, ge=2, le=256, description="Deepest nesting of JSON arrays and objects in a body (400)."
    )
    max_prompt_tokens: int = Field(
        1_048_576,
        gt=0,
        description="Longest prompt in tokens (400 `context_length_exceeded`); engines "
        "enforce their own, smaller context length too.",
    )
    max_output_tokens: int = Field(
        1_048_576,
        gt=0,
        description="Largest `max_tokens` (and a chat's `max_completion_tokens`) a request "
        "may ask for (400).",
    )
    max_n: int = Field(128, gt=0, description="Largest `n` (completions per prompt) (400).")
    max_prompts: int = Field(
        1_024, gt=0, description="Most prompts in a batch completion, or messages in a chat (400)."
    )
    max_sequences: int = Field(
        1_024,
        gt=0,
        description="Most sequences one request may ask for: prompts x `n` (400); one "
        "request goes to one engine, so this bounds the work a single request can queue there.",
    )
    max_inflight: int = Field(
        10_000,
        gt=0,
        description="Requests in flight through the router; more wait in the admission queue.",
    )
    max_inflight_per_engine: int = Field(
        0,
        ge=0,
        description="Requests in flight on one engine (routing target); when every "
        "candidate is full, requests wait in the admission queue. 0: no limit.",
    )
    admission_queue: int = Field(
        1_000,
        ge=0,
        description="Requests that may wait for capacity; beyond it, 429 at once.",
    )
    admission_timeout_s: float = Field(
        5.0,
        ge=0,
        description="Longest wait in the admission queue before 429 with Retry-After.",
    )
    default_max_tokens: int = Field(
        256,
        gt=0,
        description="Output tokens assumed for load accounting when a request sets no max_tokens.",
    )
    max_dp_size: int = Field(
        64,
        ge=1,
        le=65_536,
        description="Most data-parallel ranks an engine may announce (`dp_size` in its "
        "`/server_info`, or the ranks of vLLM's `/kv_event_sources`): the router keeps a "
        "routing target, load and index entries per rank, so an engine announcing more is "
        "refused, with one log line naming it and both numbers. Sizes the operator sets "
        "(`engines[].dp_size`, the Kubernetes annotation, `Admin/AddEngine`) are not bounded.",
    )


MAX_EVENT_MESSAGE_BYTES = 32 * 2**20
"""Default bound on one KV-event frame: vLLM publishes a batch per scheduler step, a few
hundred KB even for a long prefill chunk."""


class EventsConfig(Section):
    """KV-event ingestion."""

    enabled: bool = Field(True, description="Subscribe to engines' KV events at all.")
    replay_timeout_s: float = Field(
        2.0,
        gt=0,
        description="Wait for a replay answer this long; an unanswered replay is tried "
        "again after 1 s, doubling to 30 s.",
    )
    port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Engines with `kv_events: auto` that report no endpoints (neither "
        "/server_info nor vLLM's /kv_event_sources) publish at tcp://<engine host>:<port> "
        "(llm-d's convention: 5557); unset: such engines are tracked from decisions.",
    )
    replay_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="With `port`: the engines' replay port by the same convention (5558).",
    )
    max_message_bytes: int = Field(
        MAX_EVENT_MESSAGE_BYTES,
        gt=0,
        description="Largest KV-event frame accepted (ZMQ `MAXMSGSIZE` on the SUB and "
        "replay sockets, also of `kvroute indexer`): a publisher that sends a larger one "
        "is disconnected before the frame is read (it reconnects; its stream then "
        "replays or rebuilds).",
    )
    bind_endpoint: str | None = Field(
        None,
        description="Bind one SUB socket here for engines that connect to the router "
        "(llm-d central mode, topic kv@<ip>:<port>@<model>).",
    )
    bind_check_address: bool = Field(
        True,
        description="On the bound socket (`bind_endpoint`, TCP), apply a message only if "
        "it comes from the address of the engine its topic names (`kv@10.0.0.5:8000@m` "
        "from 10.0.0.5); others are dropped and counted "
        "(`kvroute_kv_events_address_mismatch_total`). Turn it off only behind address "
        "translation that hides the engines' addresses.",
    )
    curve_secret_key_file: Path | None = Field(
        None,
        description="The router's CURVE key (a ZeroMQ certificate with the secret key, "
        "`NAME.key_secret` as `zmq.auth.create_certificates` writes it): the bound socket "
        "becomes a CURVE server that admits only publishers holding a key in "
        "`curve_public_keys_dir`. Engines need the matching public `NAME.key` "
        "(docs/operations.md).",
    )
    curve_public_keys_dir: Path | None = Field(
        None,
        description="With `curve_secret_key_file`: a directory of the public keys "
        "(`*.key` certificates) publishers may use, one shared key or one per engine; a "
        "publisher with another key is refused at its handshake "
        "(`kvroute_kv_event_publishers_refused_total`). Read at start-up.",
    )
    via_indexer: bool = Field(
        False,
        description="A `kvroute indexer` writes the engines' KV events into the Redis "
        "index: this router does not subscribe (whatever `enabled` says), yet treats "
        "its engines as publishing events, so its decisions are provisional "
        "(`policy.provisional_ttl_s`) rather than approximate; engines with "
        "`kv_events: none` stay approximate. Needs `index.backend: redis`.",
    )

    @model_validator(mode="after")
    def _curve_keys_together(self) -> EventsConfig:
        if (self.curve_secret_key_file is None) != (self.curve_public_keys_dir is None):
            raise ValueError("curve_secret_key_file and curve_public_keys_dir go together")
        if self.curve_secret_key_file is not None and not self.bind_endpoint:
            raise ValueError("curve_secret_key_file secures bind_endpoint, which is not set")
        return self


class LinkConfig(Section):
    """One locality class of prefill-to-decode link: what moving KV over it costs."""

    bandwidth_gb_s: float = Field(12.5, gt=0, description="Bandwidth of one KV transfer in GB/s.")
    latency_s: float = Field(
        0.0,
        ge=0,
        description="Fixed seconds per transfer on top of `disaggregation.handoff_overhead_s` "
        "(connection set-up, hops).",
    )
    min_uncached_tokens: int | None = Field(
        None,
        ge=0,
        description="Split threshold over this link (default: "
        "`disaggregation.min_uncached_tokens`).",
    )


class SameNodeLink(LinkConfig):
    """Both engines on one node: NVLink."""

    bandwidth_gb_s: float = Field(
        400.0,
        gt=0,
        description="NVLink 4 moves 450 GB/s each way per H100 SXM GPU (NVIDIA's datasheet: "
        "900 GB/s bidirectional); 400 GB/s is taken.",
    )
    latency_s: float = Field(10e-6, ge=0, description="Fixed seconds per transfer.")


class SameRackLink(LinkConfig):
    """Other nodes of one rack: RDMA through the leaf switch."""

    bandwidth_gb_s: float = Field(
        50.0,
        gt=0,
        description="One 400 Gb/s InfiniBand NDR / RoCE NIC per GPU behind a non-blocking "
        "leaf switch (the DGX H100 reference architecture): 50 GB/s.",
    )
    latency_s: float = Field(20e-6, ge=0, description="Fixed seconds per transfer.")


class SameZoneLink(LinkConfig):
    """Other racks of one zone: RDMA through the spine."""

    bandwidth_gb_s: float = Field(
        12.5,
        gt=0,
        description="A spine oversubscribed 4:1 leaves about 100 Gb/s per GPU: 12.5 GB/s, "
        "the same as `transfer_bandwidth_gb_s`.",
    )
    latency_s: float = Field(100e-6, ge=0, description="Fixed seconds per transfer.")


class CrossZoneLink(LinkConfig):
    """Another zone: no RDMA fabric, TCP."""

    bandwidth_gb_s: float = Field(
        0.625,
        gt=0,
        description="One TCP flow between zones gets about 5 Gb/s (AWS: a single flow "
        "outside a cluster placement group): 0.625 GB/s.",
    )
    latency_s: float = Field(
        0.001, ge=0, description="Fixed seconds per transfer (inter-zone round trips)."
    )


class LinksConfig(Section):
    """Prefill-to-decode links by locality (docs/disaggregation.md, "Topology")."""

    same_node: SameNodeLink = Field(default_factory=SameNodeLink)
    same_rack: SameRackLink = Field(default_factory=SameRackLink)
    same_zone: SameZoneLink = Field(default_factory=SameZoneLink)
    cross_zone: CrossZoneLink = Field(default_factory=CrossZoneLink)


class DisaggregationConfig(Section):
    """Prefill/decode disaggregation: when to split, and how (docs/disaggregation.md)."""

    handoff: str = Field(
        "nixl",
        description="KV-transfer dialect of the prefill/decode pools "
        f"({_DIALECTS}; `models[].handoff` overrides it per model).",
    )

    @field_validator("handoff")
    @classmethod
    def _known_dialect(cls, value: str) -> str:
        return _dialect(value)

    min_uncached_tokens: int = Field(
        512,
        ge=0,
        description="Serve on the decode engine alone when fewer prompt tokens "
        "than this are missing from its cache: a transfer does not pay for short prompts.",
    )
    decode_hit_ratio: float = Field(
        0.8,
        gt=0,
        le=1,
        description="Serve on the decode engine alone when it already holds "
        "at least this share of the prompt (multi-turn chats keep their prefix there).",
    )
    kv_bytes_per_token: int = Field(
        131_072,
        gt=0,
        description="KV-cache bytes per token (Llama-3.1-8B in bf16: 32 layers "
        "x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes).",
    )
    transfer_bandwidth_gb_s: float = Field(
        12.5,
        gt=0,
        description="Prefill-to-decode link bandwidth in GB/s (100 Gb/s RDMA), for "
        "engine pairs whose locality is unknown (no `engines[].topology`).",
    )
    links: LinksConfig = Field(default_factory=LinksConfig)
    min_link_bandwidth_gb_s: float = Field(
        2.5,
        ge=0,
        description="Never split over a link slower than this (GB/s): prefill engines "
        "behind one are no candidates, and a decode engine with only such prefill "
        "engines serves alone (`slow_link`). 2.5 GB/s (20 Gb/s): below it there is no "
        "RDMA fabric. Applies to links whose locality is known; 0: off.",
    )
    min_prefill_engines: int = Field(
        1,
        ge=1,
        description="Serve on the decode engine alone while fewer healthy prefill "
        "engines than this serve the model (`prefill_pool_small`): a pool this small "
        "queues splits behind each other.",
    )
    prefill_s_per_token: float = Field(
        50e-6,
        gt=0,
        description="Estimated prefill time per uncached token on a decode "
        "engine (the work a split moves off it).",
    )
    handoff_overhead_s: float = Field(
        0.003,
        ge=0,
        description="Fixed cost of a split: the extra leg and the handoff.",
    )
    fallback_to_decode: bool = Field(
        True,
        description="When prefill fails on two prefill engines, serve on the decode "
        "engine alone (false: answer 502/504).",
    )
    rewrite_loopback_host: bool = Field(
        False,
        description="NIXL: when a prefill engine reports a loopback remote_host "
        "although it is not on loopback, replace it with the engine's own host (remote_port "
        "is never changed). Off: only warn.",
    )
    decode_weight: float = Field(
        1.0,
        ge=0,
        description="Decode engine choice: cost per KV block held by its "
        "decoding requests (decode pools balance memory-bound work).",
    )
    decode_queue_weight: float = Field(
        1.0,
        ge=0,
        description="Decode engine choice: cost per block of prefill queued there.",
    )
    decode_prefix_weight: float = Field(
        0.5,
        ge=0,
        description="Decode engine choice: cost per block of the prompt it does "
        "not hold (what it would have to pull or prefill).",
    )
    decode_kv_usage_weight: float = Field(
        32.0,
        ge=0,
        description="Decode engine choice: block-equivalents of cost at 100% "
        "engine-reported KV usage (replaces `policy.kv_usage_weight` there). Reports see "
        "other routers' traffic, but are as old as the last scrape and also count this "
        "router's own requests, which `decode_weight` counts already. 32 blocks (512 "
        "tokens at block size 16): a full engine against an empty one weighs less than "
        "one 1,000-token request in flight, so reports order engines the router sees as "
        "(nearly) equal without outweighing its own accounting.",
    )
    decode_waiting_weight: float = Field(
        4.0,
        ge=0,
        description="Decode engine choice: block-equivalents per engine-reported waiting "
        "request (a decode engine that queues is short of KV memory or batch slots; "
        "replaces `policy.waiting_weight` there); small for the reasons "
        "`decode_kv_usage_weight` gives.",
    )
    decode_running_weight: float = Field(
        1.0,
        ge=0,
        description="Decode engine choice: block-equivalents per engine-reported running "
        "request (each one shares every decode step; replaces `policy.running_weight` "
        "there); small for the reasons `decode_kv_usage_weight` gives.",
    )


class TokenizerConfig(Section):
    """How the router turns a model's prompts into token ids (docs/configuration.md)."""

    mode: Literal["auto", "words", "hf", "engine", "approximate"] = Field(
        "auto",
        description="`auto`: at discovery, find the served model's own tokenizer files and "
        "use them (`hf`): a directory the engine reports (vLLM's /v1/models `root`, "
        "SGLang's tokenizer_path), `model_dirs`, the Hugging Face cache, else the hub "
        "(`download`, in the background); each checked against one /tokenize of the "
        "engine's. The emulator's words tokenizer if the engine answers like one; else "
        "`approximate` (its characters per token calibrated from the engines' usage), "
        "never `engine`. Until settled, and while an engine does not answer (asked again "
        "5 s later, the wait doubling to 60 s), `approximate`. `hf`: a local tokenizer.json "
        "(+ tokenizer_config.json for chat).",
    )
    path: str | None = Field(None, description="tokenizer.json, for `hf`.")
    config_path: str | None = Field(
        None, description="tokenizer_config.json (chat template, special tokens), for `hf`."
    )
    chat_template: str | None = Field(
        None, description="A chat template file that overrides the one in config_path."
    )
    chars_per_token: int = Field(
        4,
        ge=1,
        le=64,
        description="Characters per pseudo-token in `approximate` mode (an `auto` pool in "
        "approximate mode measures its own from the engines' `usage.prompt_tokens` once "
        "it has read 20 answers).",
    )
    cache_size: int = Field(
        2048, ge=0, description="Recent prompts whose `engine` tokenization is remembered."
    )
    recent_prompt_tokens: int = Field(
        4_194_304,
        ge=0,
        le=1 << 30,
        description="`hf` and `approximate` modes remember the token ids of recent prompts "
        "and chats, and `hf` those of conversations up to their last special tokens, up to "
        "this many tokens in all (4 bytes each): a prompt sent again is not tokenized "
        "again, and a conversation's next turn tokenizes only what it adds; 0 turns it off.",
    )
    model_dirs: list[str] = Field(
        default_factory=list,
        description="`auto`: directories where models' files are mounted (a shared model "
        "volume mounted elsewhere than on the engines), each searched for "
        "`<dir>/<name>/tokenizer.json` with `<name>` the engine's `root` or the served "
        "model name, whole and by its last path component.",
    )
    download: bool = Field(
        True,
        description="`auto`: when no tokenizer is found on disk, fetch tokenizer.json, "
        "tokenizer_config.json and chat_template.jinja of the hub id the engine reports "
        "(its `root`, never the served name) from the Hugging Face hub (`HF_ENDPOINT`, "
        "`HF_TOKEN`) into the Hugging Face cache, in the background, as vLLM itself "
        "fetches the model; never with `HF_HUB_OFFLINE=1`.",
    )
    download_timeout_s: float = Field(
        30.0,
        gt=0,
        le=600,
        description="`auto`: how long the hub download of one model's tokenizer may take "
        "before the pool settles on `approximate`.",
    )
    mm_placeholder_tokens: int = Field(
        DEFAULT_MM_PLACEHOLDER_TOKENS,
        ge=1,
        le=1 << 20,
        description="Placeholder tokens per image, audio or video part of a chat in `words` "
        "mode; must equal the emulator's `--mm-placeholder-tokens`.",
    )

    @model_validator(mode="after")
    def _hf_needs_files(self) -> TokenizerConfig:
        if self.mode == "hf" and not self.path:
            raise ValueError("mode hf needs path (a tokenizer.json)")
        return self


class ModelConfig(Section):
    """Settings of one model's pool (engines serving it, and its LoRA adapters)."""

    name: str = Field(min_length=1, description="Model name as requests and engines give it.")
    tokenizer: TokenizerConfig | None = Field(
        None, description="This model's tokenizer (default: the top-level `tokenizer`)."
    )
    block_size: int | None = Field(
        None, gt=0, description="This pool's KV block size (default: the top-level one)."
    )
    handoff: str | None = Field(
        None,
        description=f"KV-transfer dialect of this model's prefill/decode pools ({_DIALECTS}; "
        "default: `disaggregation.handoff`).",
    )

    @field_validator("handoff")
    @classmethod
    def _known_dialect(cls, value: str | None) -> str | None:
        return _dialect(value)


class TokenizerGuardConfig(Section):
    """Detects a router tokenizer that disagrees with the engine's."""

    window: int = Field(
        50, ge=5, description="Responses compared (router prompt tokens vs engine usage)."
    )
    max_mismatch_ratio: float = Field(
        0.2,
        gt=0,
        le=1,
        description="More disagreeing responses than this share in the window "
        "switch the model's pool to approximate mode until restart or reload.",
    )


class ResponsesConfig(Section):
    """The OpenAI Responses API: which engine holds each stored response."""

    ttl_s: float = Field(
        3600.0,
        gt=0,
        description="How long the router remembers the engine that produced a response "
        "(for `previous_response_id`, `GET /v1/responses/{id}` and `/cancel`); in Redis too "
        "when `index.backend` is `redis` or `replicated`, so every replica finds it.",
    )
    max_remembered: int = Field(
        100_000,
        ge=1,
        description="Response ids this router remembers in memory (the oldest are "
        "forgotten first; Redis keeps its own for `ttl_s`).",
    )
    ask_engines: int = Field(
        64,
        ge=0,
        description="When no replica remembers a response id (it was written while Redis "
        "was away, or before this router started), ask up to this many healthy engines at "
        "once (`GET /v1/responses/{id}`) which one holds it, and remember the answer; 0: "
        "an unknown id is a 404 (`GET`, `/cancel`) or routed as any request "
        "(`previous_response_id`).",
    )
    ask_timeout_s: float = Field(
        5.0,
        gt=0,
        description="How long asking the engines for an unknown response id may take.",
    )
    ask_per_second: float = Field(
        20.0,
        gt=0,
        description="Unknown response ids asked about per second at most (a burst of as "
        "many); beyond, an id is unknown without asking, so made-up ids cannot make the "
        "router send the engines more than this times `ask_engines` GETs a second.",
    )
    ask_per_caller_per_second: float = Field(
        5.0,
        gt=0,
        description="Unknown response ids one caller may have asked about per second (a "
        "burst of as many), within `ask_per_second`: one caller sending made-up ids "
        "cannot use up every other caller's questions. A caller is the API key it "
        "presented when `auth.api_keys` is set, else its address.",
    )


class DiscoveryConfig(Section):
    """Where engines come from besides the static `engines` list."""

    kubernetes: KubernetesDiscoveryConfig = Field(default_factory=KubernetesDiscoveryConfig)


class TracingConfig(Section):
    """OpenTelemetry tracing of the request path (needs the `otel` extra)."""

    enabled: bool = Field(
        False, description="Trace requests (a server span, the routing decision, engine calls)."
    )
    exporter: Literal["none", "console", "otlp"] = Field(
        "none",
        description="`none`: spans only propagate `traceparent` to engines; `console`: "
        "print them; `otlp`: send them over OTLP/HTTP (needs "
        "opentelemetry-exporter-otlp-proto-http).",
    )
    endpoint: str | None = Field(
        None,
        description="OTLP/HTTP traces endpoint (default: $OTEL_EXPORTER_OTLP_ENDPOINT or "
        "http://localhost:4318/v1/traces).",
    )
    service_name: str = Field("kvroute", min_length=1, description="`service.name` of spans.")
    sample_ratio: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Share of new traces sampled; requests carrying a sampled "
        "`traceparent` follow their caller's choice.",
    )


class IndexerEngineConfig(Section):
    """One engine stream the standalone indexer follows (connect mode: vLLM binds its PUB)."""

    endpoint: str = Field(
        ..., min_length=1, description="The engine's HTTP `host:port`: its identity in the index."
    )
    rank: int = Field(0, ge=0, description="Data-parallel rank (each rank is its own stream).")
    model: str = Field(
        ..., min_length=1, description="Model the engine serves; seeds the root block keys."
    )
    events: str = Field(
        ..., min_length=1, description="The engine's KV-event PUB endpoint, `tcp://host:5557`."
    )
    replay: str | None = Field(
        None,
        description="The engine's replay endpoint, `tcp://host:5558`. Without it a gap or a "
        "takeover drops the engine's entries and rebuilds them from new events.",
    )
    topic: str = Field("", description="Topic to subscribe to (vLLM's default: all).")
    block_size: int | None = Field(
        None, gt=0, description="The engine's block size; default: the top-level `block_size`."
    )


class IndexerConfig(Section):
    """The standalone indexer (``kvroute indexer``): engine KV events into the Redis index."""

    engines: list[IndexerEngineConfig] = Field(default_factory=list)
    lease_ms: int = Field(
        5000,
        gt=0,
        description="Writer lease per engine stream: a standby indexer takes a stream over "
        "at most this long after its writer stops renewing.",
    )
    renew_ms: int | None = Field(
        None, gt=0, description="How often leases are renewed (default: a third of `lease_ms`)."
    )
    write_timeout_s: float = Field(
        5.0, gt=0, description="Bound on one pipelined write of event batches."
    )
    replay_timeout_s: float = Field(
        2.0, gt=0, description="How long to wait for an engine's replay socket to answer."
    )

    @field_validator("engines")
    @classmethod
    def _each_engine_once(cls, engines: list[IndexerEngineConfig]) -> list[IndexerEngineConfig]:
        seen = set()
        for engine in engines:
            if (engine.endpoint, engine.rank) in seen:
                raise ValueError(f"engine {engine.endpoint} rank {engine.rank} is listed twice")
            seen.add((engine.endpoint, engine.rank))
        return engines

    @field_validator("renew_ms")
    @classmethod
    def _renew_within_lease(cls, renew_ms: int | None, info: ValidationInfo) -> int | None:
        lease_ms = info.data.get("lease_ms")
        if renew_ms is not None and lease_ms is not None and renew_ms >= lease_ms:
            raise ValueError("must be shorter than lease_ms")
        return renew_ms


DEFAULT_ENGINE_CIDRS = (
    "127.0.0.0/8",
    "::1/128",
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "fc00::/7",
)
"""Where engines may live by default: loopback and private ranges (never link-local
addresses such as cloud metadata services)."""


class AuthConfig(Section):
    """Credentials of the client and admin APIs, and what engines are sent (docs/security.md).

    Keys are compared in constant time and never logged. Prefer the ``*_file`` keys
    (a Kubernetes Secret mounted as a file, one key per line) to keys in the YAML file.
    """

    api_keys: list[SecretStr] = Field(
        default_factory=list,
        description="Client keys (`Authorization: Bearer KEY`) for /v1/*, the engine routes "
        "outside it (`/tokenize`, `/pooling`, ...) and the gRPC Router service; empty with no "
        "`api_keys_file`: the client API is open.",
    )
    api_keys_file: Path | None = Field(
        None,
        description="A file of client keys, one per line (re-read on SIGHUP). A file "
        "that holds no key is refused at start-up and on reload (the running keys stay).",
    )
    admin_keys: list[SecretStr] = Field(
        default_factory=list,
        description="Admin keys for /admin/* and the gRPC Admin service (a client key is "
        "refused there with 403); none: admin calls are accepted from loopback only.",
    )
    admin_keys_file: Path | None = Field(
        None,
        description="A file of admin keys, one per line (re-read on SIGHUP); one with no "
        "key is refused like `api_keys_file`.",
    )
    metrics_need_key: bool = Field(
        False, description="/metrics asks for a client or admin key too (off: open, as usual)."
    )
    accept_x_api_key: Literal["anthropic", "all", "off"] = Field(
        "anthropic",
        description="Where a client key may come as `x-api-key: KEY` (Anthropic's header) "
        "instead of `Authorization: Bearer KEY`: `anthropic` on /v1/messages and the paths "
        "under it, `all` on every client route, `off` nowhere. `Authorization` wins when "
        "both are sent; admin calls take `Authorization` only.",
    )
    upstream: Literal["pass", "drop", "token"] = Field(
        "pass",
        description="`Authorization` sent to engines: `pass` the client's, `drop` it, or "
        "`token`: `Bearer upstream_token` (engines started with --api-key).",
    )
    upstream_token: SecretStr | None = Field(None, description="The engines' key (`token`).")
    upstream_token_file: Path | None = Field(
        None, description="A file holding the engines' key (`token`)."
    )
    engine_cidrs: list[str] = Field(
        default_factory=lambda: list(DEFAULT_ENGINE_CIDRS),
        description="Engines added at run time (admin API, Kubernetes discovery) must "
        "resolve into these networks, and so must their KV-event and replay endpoints, "
        "the event endpoints engines report off their own host, and the NIXL side "
        "channels prefill engines name; the default is loopback and private ranges.",
    )

    allow_client_handoff_fields: bool = Field(
        False,
        description="Trust clients with the router's handoff fields: pass a client's own "
        "`kv_transfer_params`, `ec_transfer_params` and SGLang `bootstrap_host` / "
        "`bootstrap_port` / `bootstrap_room` on to engines, at the top level or nested where "
        "engines read them (`vllm_xargs`, `sampling_params.extra_args`, `extra_body`). Off "
        "(the default): they are removed from every "
        "client body (HTTP, gRPC `Generate`, ext_proc), and gRPC `Pick` refuses them with "
        "`INVALID_ARGUMENT` (the gateway forwards that body itself). Turn on only when "
        "every client is a component of yours that runs its own disaggregation.",
    )

    @field_validator("engine_cidrs")
    @classmethod
    def _cidrs(cls, value: list[str]) -> list[str]:
        for cidr in value:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"{cidr!r} is not a network (e.g. 10.0.0.0/8)") from None
        return value

    @model_validator(mode="after")
    def _token(self) -> AuthConfig:
        if self.upstream == "token" and not (self.upstream_token or self.upstream_token_file):
            raise ValueError("auth.upstream: token needs upstream_token or upstream_token_file")
        return self


class TlsConfig(Section):
    """TLS on the router's listeners (docs/security.md). Certificate files are re-read
    when they change, so cert-manager rotations need no restart."""

    cert_file: Path | None = Field(
        None, description="PEM certificate chain; with `key_file`, the listeners speak TLS."
    )
    key_file: Path | None = Field(None, description="PEM private key of `cert_file`.")
    client_ca_file: Path | None = Field(
        None,
        description="PEM CA bundle: gRPC and ext_proc clients must present a certificate "
        "it signed (mutual TLS); also HTTP clients with `client_auth_http`.",
    )
    client_auth_http: bool = Field(
        False, description="Require client certificates on the HTTP listener too."
    )
    listeners: list[Literal["http", "grpc", "extproc"]] = Field(
        default_factory=lambda: ["http", "grpc", "extproc"],
        description="Which listeners use TLS once a certificate is set.",
    )
    reload_interval_s: float = Field(
        10.0, gt=0, description="How often certificate files are checked for changes."
    )

    @model_validator(mode="after")
    def _pair(self) -> TlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("tls.cert_file and tls.key_file go together")
        if self.client_ca_file is not None and self.cert_file is None:
            raise ValueError("tls.client_ca_file needs tls.cert_file and tls.key_file")
        return self

    def on(self, listener: str) -> bool:
        """Whether ``listener`` (http, grpc, extproc) speaks TLS."""
        return self.cert_file is not None and listener in self.listeners


class Config(Section):
    """Everything ``kvroute serve`` reads."""

    block_size: int = Field(
        16,
        gt=0,
        description="Tokens per KV block; must match the engines. Unset (here and in "
        "`models[].block_size`), a pool adopts the block size its first engine reports "
        "(`vllm:cache_config_info`, /server_info) and refuses engines that differ from it.",
    )
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    engines: list[EngineConfig] = Field(
        default_factory=list, description="Static engines (`--engine URL` adds to these)."
    )
    health: HealthConfig = Field(default_factory=HealthConfig)
    scrape: ScrapeConfig = Field(default_factory=ScrapeConfig)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)
    tokenizer: TokenizerConfig = Field(
        default_factory=TokenizerConfig, description="Default tokenizer of every model."
    )
    models: list[ModelConfig] = Field(
        default_factory=list,
        description="Per-model settings (tokenizer, block size, handoff dialect).",
    )
    tokenizer_guard: TokenizerGuardConfig = Field(default_factory=TokenizerGuardConfig)
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig)
    disaggregation: DisaggregationConfig = Field(default_factory=DisaggregationConfig)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    grpc: GrpcConfig = Field(default_factory=GrpcConfig)
    extproc: ExtProcConfig = Field(default_factory=ExtProcConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    tls: TlsConfig = Field(default_factory=TlsConfig)
    flow: FlowConfig = Field(default_factory=FlowConfig)
    _deprecations: list[str] = PrivateAttr(default_factory=list)

    @property
    def deprecations(self) -> list[str]:
        """One line per deprecated key the sources set (see :data:`RENAMED_KEYS`), saying
        where it was set and what replaced it; set by :func:`load_config`."""
        return self._deprecations

    @model_validator(mode="after")
    def _flow_keys_are_client_keys(self) -> Config:
        inline = {k.get_secret_value() for k in self.auth.api_keys}
        if inline and not self.auth.api_keys_file:
            unknown = [
                i for i, k in enumerate(self.flow.keys) if k.key.get_secret_value() not in inline
            ]
            if unknown:
                raise ValueError(
                    f"flow.keys[{unknown[0]}].key is not one of auth.api_keys (it would "
                    "never be accepted)"
                )
        return self

    @model_validator(mode="after")
    def _indexer_needs_redis(self) -> Config:
        if self.events.via_indexer and self.index.backend != "redis":
            raise ValueError("events.via_indexer needs index.backend: redis")
        return self

    def block_size_configured(self, model: str) -> bool:
        """Whether a model pool's block size was set (top-level or ``models[]``) rather
        than left to the default, which the pool then learns from its engines."""
        if "block_size" in self.model_fields_set:
            return True
        return any(m.name == model and m.block_size is not None for m in self.models)

    def model_settings(self, model: str) -> tuple[TokenizerConfig, int]:
        """The tokenizer settings and block size of a model's pool."""
        for m in self.models:
            if m.name == model:
                return m.tokenizer or self.tokenizer, m.block_size or self.block_size
        return self.tokenizer, self.block_size

    def handoff_for(self, model: str) -> str:
        """The KV-transfer dialect of a model's prefill/decode pools."""
        for m in self.models:
            if m.name == model and m.handoff is not None:
                return m.handoff
        return self.disaggregation.handoff

    indexer: IndexerConfig = Field(default_factory=IndexerConfig)


class ConfigError(ValueError):
    """Invalid configuration; the message names every offending field."""


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The section model whose keys the last part of ``loc`` is one of (None if unknown)."""
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # an item of a list: the same model as the list's
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        inner = [field.annotation, *get_args(field.annotation)]
        found = [a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)]
        if not found:
            return None
        model = found[0]
    return model


def _did_you_mean(loc: tuple[Any, ...]) -> str:
    """``; did you mean X?`` for a misspelt key, when one key is close enough."""
    model = _model_at(loc)
    if model is None or not loc:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.7)
    return f"; did you mean {close[0]}?" if close else ""


def _holds(tree: Any, loc: tuple[Any, ...], *, lists: bool = True) -> bool:
    """Whether a nested mapping sets ``loc`` (through list items only if ``lists``)."""
    node = tree
    for part in loc:
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif lists and isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            return False
    return True


@dataclass(frozen=True)
class _Sources:
    """What each source of a configuration set, to say where a bad key came from."""

    path: str | Path | None
    file: Any
    env_names: Mapping[tuple[str, ...], str]
    flags: Mapping[str, Any]
    before_flags: Any
    """The file and the environment merged: what flags that add list items extend."""

    def of(self, loc: tuple[Any, ...]) -> str:
        # Flags win over the environment, which wins over the file. Flags that add list
        # items (--engine) carry the file's items too: only the items they add are
        # blamed on flags.
        if (loc and _holds(self.flags, loc, lists=False)) or self._added_by_flags(loc):
            return " (from a command-line flag)"
        keys = tuple(str(p) for p in loc)
        for env_path, name in self.env_names.items():
            shared = min(len(env_path), len(keys))
            if shared and env_path[:shared] == keys[:shared]:
                return f" (from environment variable {name})"
        if self.path is not None and _holds(self.file, loc):
            return f" (in {self.path})"
        return ""

    def _added_by_flags(self, loc: tuple[Any, ...]) -> bool:
        """Whether ``loc`` is in a list item that flags appended to the file's list."""
        index = next((i for i, part in enumerate(loc) if isinstance(part, int)), None)
        if index is None or not _holds(self.flags, loc[:index], lists=False):
            return False
        listed: Any = self.before_flags
        for part in loc[:index]:
            listed = listed.get(part) if isinstance(listed, Mapping) else None
        return loc[index] >= (len(listed) if isinstance(listed, list) else 0)


def _format_errors(
    exc: ValidationError, sources: _Sources, renamed: Mapping[str, str] | None = None
) -> str:
    """One line per error; a key set under its deprecated name (``renamed``: new -> old)
    is named both ways, and blamed on the source that set the old one."""
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        where = ".".join(str(p) for p in loc) or "(root)"
        hint = _did_you_mean(loc) if err["type"] == "extra_forbidden" else ""
        old = (renamed or {}).get(where)
        if old is not None:
            where = f"{where} (set as {old})"
            loc = tuple(old.split("."))
        lines.append(f"{where}: {err['msg']}{hint}{sources.of(loc)}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[path[-1]] = value


def env_names(environ: Mapping[str, str]) -> dict[tuple[str, ...], str]:
    """Key path -> the ``KVROUTE_A__B`` variable that sets it (process switches and
    Kubernetes service links are not configuration)."""
    names = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name == ENV_PREFIX or name in PROCESS_SWITCHES:
            continue
        if is_service_link(name, value):
            continue
        path = tuple(p.lower() for p in name[len(ENV_PREFIX) :].split("__") if p)
        if path:
            names[path] = name
    return names


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Nested overrides from ``KVROUTE_A__B=value`` variables."""
    tree: dict[str, Any] = {}
    for path, name in env_names(environ).items():
        raw = environ[name]
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        _set_path(tree, list(path), value)
    return tree


def merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge: mappings merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build the configuration from a YAML file, the environment and flag overrides."""
    data: dict[str, Any] = {}
    file: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, encoding="utf-8") as stream:  # YAML errors then name the file
                loaded = yaml.safe_load(stream)
        except OSError as exc:
            raise ConfigError(f"cannot read configuration file {path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"configuration file {path} is not UTF-8 text: {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"configuration file {path} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"configuration file {path} must hold a mapping at the top level")
        data = file = loaded or {}
    environ = os.environ if environ is None else environ
    data = before_flags = merge(data, env_overrides(environ))
    if overrides:
        data = merge(data, overrides)
    sources = _Sources(path, file, env_names(environ), overrides or {}, before_flags)
    try:
        data, renamed = move_renamed(data)
    except RenamedKeyConflict as exc:
        old, new = (tuple(key.split(".")) for key in (exc.old, exc.new))
        named = RenamedKeyConflict(exc.old, exc.new, sources.of(old), sources.of(new))
        raise ConfigError(f"invalid configuration:\n  {named}") from None
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        moved = {new: old for old, new in renamed}
        raise ConfigError(_format_errors(exc, sources, moved)) from None
    config._deprecations = [
        f"configuration key {old}{sources.of(tuple(old.split('.')))} is deprecated: use {new}"
        for old, new in renamed
    ]
    return config


def _type_name(annotation: Any) -> str:
    args = get_args(annotation)
    if get_origin(annotation) is Literal:
        return " or ".join(f"`{a}`" for a in args)
    if args and get_origin(annotation) in (Union, UnionType):
        return " or ".join(_type_name(a) for a in args)
    if annotation is type(None):
        return "null"
    text = getattr(annotation, "__name__", None) or str(annotation)
    # Sections are named by their class, wherever they live (router.config, a plugin's).
    return re.sub(r"\brouter(?:\.\w+)*\.", "", text.replace("typing.", ""))


def describe(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key path, type, default, description) of every configuration key, depth first."""
    rows: list[tuple[str, str, str, str]] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.extend(describe(annotation, f"{path}."))
            continue
        if field.default_factory is not None:
            default = "[]" if field.default_factory is list else "(see below)"
        elif field.is_required():
            default = "required"
        else:
            default = repr(field.default)
        rows.append((path, _type_name(annotation), default, field.description or ""))
        inner = f"{path}[]." if get_origin(annotation) is list else f"{path}."
        for arg in get_args(annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                rows.extend(describe(arg, inner))
    return rows


def markdown_reference() -> str:
    """The configuration reference table docs/configuration.md embeds."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for path, kind, default, text in describe():
        cell = kind.replace("|", "\\|")
        lines.append(f"| `{path}` | {cell} | `{default}` | {text} |")
    return "\n".join(lines)


def update_reference(path: str | Path) -> None:
    """Rewrite the reference table that ends a markdown file (docs/configuration.md)."""
    doc = Path(path)
    text = doc.read_text()
    start = text.index("| key | type | default | meaning |")
    doc.write_text(text[:start] + markdown_reference() + "\n")


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--update"] and len(sys.argv) == 3:
        update_reference(sys.argv[2])
    else:
        print(markdown_reference())
