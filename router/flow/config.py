"""The ``flow`` section of the configuration: flow control's priority bands, tenants,
API keys, rate limits and saturation (router/flow/; docs/reliability.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_serializer, field_validator, model_validator

from router.config_section import Section
from router.redaction import redacted


class FlowKeyConfig(Section):
    """Flow-control settings of one client API key (``flow.keys``)."""

    key: SecretStr = Field(
        description="The API key (as sent in `Authorization: Bearer KEY`); it must also be "
        "one of `auth.api_keys` when those are set."
    )
    name: str | None = Field(
        None,
        min_length=1,
        max_length=64,
        description="The tenant this key's requests belong to (metrics, logs, fairness, "
        "`flow.tenants` limits), whatever `x-kvroute-tenant` or the body's `user` say "
        "(unless `may_set_tenant`); unset: a digest of the key.",
    )
    may_set_tenant: bool = Field(
        False,
        description="Let this key's requests name their tenant (`x-kvroute-tenant`, the "
        "body's `user`, as `flow.tenant_from` says), e.g. the key of a gateway that "
        "serves several tenants. Off: the key's own tenant (`name`) binds its requests, "
        "so a client cannot dodge its tenant's limits or spend another's by naming one.",
    )
    priority: int | None = Field(
        None,
        ge=-1000,
        le=1000,
        description="Priority of this key's requests that send no `x-kvroute-priority`; "
        "unset: `flow.default_priority`.",
    )
    max_priority: int | None = Field(
        None,
        ge=-1000,
        le=1000,
        description="Highest priority this key's requests may ask for with "
        "`x-kvroute-priority` (a higher one is lowered to it); unset: no cap.",
    )
    rpm: int | None = Field(
        None, gt=0, description="Requests per rate window (`flow.rate_limit.window_s`)."
    )
    tpm: int | None = Field(
        None,
        gt=0,
        description="Tokens (prompt + output) per rate window; output tokens are estimated "
        "from `max_tokens` at admission and corrected from the answer's usage.",
    )


class FlowTenantConfig(Section):
    """Limits of one tenant (``flow.tenants``), whatever key its requests come with."""

    name: str = Field(min_length=1, max_length=64, description="The tenant's name.")
    rpm: int | None = Field(None, gt=0, description="Requests per rate window.")
    tpm: int | None = Field(None, gt=0, description="Tokens per rate window.")
    priority: int | None = Field(
        None, ge=-1000, le=1000, description="Default priority of the tenant's requests."
    )


class FlowRateLimitConfig(Section):
    """Where the token buckets of ``flow.keys`` and ``flow.tenants`` live."""

    backend: Literal["local", "redis"] = Field(
        "local",
        description="`local`: each router replica limits on its own; `redis`: replicas "
        "share the buckets (one atomic script per admission), falling back to local "
        "buckets while Redis is unavailable (`kvroute_rate_limit_fallbacks_total`).",
    )
    redis_url: str | None = Field(
        None,
        description="Redis for `backend: redis`; unset: `index.redis.url`.",
    )
    namespace: str = Field("kvroute", min_length=1, description="Prefix of the bucket keys.")
    window_s: float = Field(
        60.0,
        gt=0,
        le=86_400,
        description="The rate window `rpm` and `tpm` count in (60: per minute; tests and "
        "benchmarks may shorten it).",
    )
    timeout_s: float = Field(
        0.05,
        gt=0,
        description="Longest wait for Redis per admission before the local bucket decides.",
    )
    burst: float = Field(
        0.05,
        gt=0,
        le=1,
        description="Share of a window's limit a bucket holds, so may pass at once (at "
        "least one request); over a window at most `limit * (1 + burst)` pass.",
    )

    @field_serializer("redis_url", when_used="json")
    def _url_shown(self, url: str | None) -> str | None:
        return redacted(url) if url else url


class FlowSaturationConfig(Section):
    """How full a pool is (``kvroute_pool_saturation``) and when the queue sheds."""

    shed_at: float = Field(
        1.0,
        gt=0,
        le=1,
        description="At this saturation, sheddable requests (negative priority) are "
        "refused with 429 instead of queued, and queued ones are evicted first.",
    )
    engine_waiting: float = Field(
        8.0,
        gt=0,
        description="Engine-reported waiting requests (`vllm:num_requests_waiting`) at "
        "which an engine counts as saturated.",
    )
    engine_queued_tokens: int = Field(
        32_768,
        gt=0,
        description="Queued prefill tokens the router has sent an engine at which it "
        "counts as saturated.",
    )
    engine_inflight: int = Field(
        64,
        gt=0,
        description="Requests in flight on an engine at which it counts as saturated "
        "(`limits.max_inflight_per_engine` when that is set).",
    )
    queue_waiting: int = Field(
        16,
        gt=0,
        description="Requests of a pool waiting in the admission queue at which the pool "
        "counts as saturated.",
    )


class FlowConfig(Section):
    """Flow control (docs/reliability.md): priority bands, fairness across tenants,
    rate limits and saturation, on every front end. Off: the admission queue is the
    plain first-come-first-served queue of `limits`."""

    enabled: bool = Field(
        False,
        description="Queue by priority band and tenant, apply rate limits and shed by "
        "saturation; off: one FIFO admission queue (`limits.*`).",
    )
    default_priority: int = Field(
        0,
        ge=-1000,
        le=1000,
        description="Priority of a request that sends none and whose key or tenant sets "
        "none. Negative priorities are sheddable.",
    )
    max_priority: int = Field(
        1000,
        ge=-1000,
        le=1000,
        description="Highest priority a request may ask for with `x-kvroute-priority` (a "
        "higher one is lowered to it; a key's `max_priority` caps its own requests "
        "further). Gateway metadata and configured defaults are not capped.",
    )
    tenant_from: list[Literal["header", "api_key", "user"]] = Field(
        default_factory=lambda: ["header", "api_key", "user"],
        min_length=1,
        description="Where a request's tenant comes from, first found wins: "
        "`x-kvroute-tenant`, the API key (`flow.keys[].name` or a digest), the body's "
        "OpenAI `user` field. None found: tenant `default`. A key listed in `flow.keys` "
        "is its own tenant whatever this says, unless its `may_set_tenant` is on.",
    )
    fairness: Literal["vtc", "round_robin"] = Field(
        "vtc",
        description="Which tenant's request a band serves next: `vtc` the tenant with the "
        "fewest tokens served (prompt + output; virtual token counter), `round_robin` "
        "tenants in turn.",
    )
    ordering: Literal["fifo", "deadline"] = Field(
        "fifo",
        description="Order within a tenant: `fifo`, or `deadline`: the earliest deadline "
        "first (`x-kvroute-deadline-ms`, a gRPC deadline), then arrival.",
    )
    band_queue: int = Field(
        1_000, ge=0, description="Requests that may wait in one priority band (429 beyond)."
    )
    tenant_share: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Most of `limits.max_inflight` one tenant may hold; a tenant at its "
        "share waits even when a slot is free, which is kept for other tenants' requests "
        "(isolation at the cost of idle slots). 1: no cap.",
    )
    max_wait_s: dict[int, float] = Field(
        default_factory=dict,
        description="Longest wait per band (`{priority: seconds}`); a band not named "
        "waits `limits.admission_timeout_s`.",
    )
    max_wait_status: Literal[429, 503] = Field(
        429, description="Answer to a request that waited its band's longest wait."
    )
    prefill_isolation: bool = Field(
        True,
        description="Route a request away from engines where a request that outranks it "
        "(a higher band; within a band, when its tenant has a backlog or holds its "
        "whole `flow.tenant_share`, a tenant with fewer requests in flight and waiting) is "
        "still prefilling, so that it does not share that prefill's engine steps; with "
        "no other engine it waits for such a prefill to end, up to "
        "`flow.prefill_isolation_wait_s`. gRPC `Pick` and ext_proc only steer.",
    )
    prefill_isolation_wait_s: float = Field(
        1.0,
        ge=0,
        description="Longest a request waits for outranking prefills to end before it "
        "is routed beside them (counts in its TTFT, shown as `yielded=` in "
        "`x-kvroute-reason`).",
    )
    prefill_reserve: int = Field(
        1,
        ge=0,
        description="With prefill isolation, while requests that outrank a request were "
        "routed within `flow.prefill_reserve_window_s`: prefills of its rank and below "
        "run one an engine, on all but this many engines of the pool (or all but as "
        "many as outranking requests are prefilling and waiting for, if more), so that "
        "the next higher-ranked request finds an engine with no prefill to share (lower "
        "ranks lose that prefill capacity meanwhile). A pool of one engine is never "
        "reserved. 0: off.",
    )
    prefill_reserve_window_s: float = Field(
        10.0,
        gt=0,
        description="How long after its last request a class of requests (priority "
        "band, tenant) keeps engines reserved for itself (`flow.prefill_reserve`).",
    )
    objectives: dict[str, int] = Field(
        default_factory=dict,
        description="Priority of a request by its InferenceObjective (the gateway's "
        "`x-gateway-inference-objective` header), when it sends no `x-kvroute-priority`.",
    )
    keys: list[FlowKeyConfig] = Field(
        default_factory=list, description="Per API key: tenant name, priority, rate limits."
    )
    tenants: list[FlowTenantConfig] = Field(
        default_factory=list, description="Per tenant: rate limits and default priority."
    )
    rate_limit: FlowRateLimitConfig = Field(default_factory=FlowRateLimitConfig)
    saturation: FlowSaturationConfig = Field(default_factory=FlowSaturationConfig)

    @field_validator("max_wait_s")
    @classmethod
    def _waits_positive(cls, waits: dict[int, float]) -> dict[int, float]:
        for band, seconds in waits.items():
            if seconds < 0:
                raise ValueError(f"band {band}: a wait cannot be negative ({seconds})")
        return waits

    @model_validator(mode="after")
    def _unique_names(self) -> FlowConfig:
        names = [t.name for t in self.tenants]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"flow.tenants names a tenant twice: {', '.join(sorted(dup))}")
        keys = [k.key.get_secret_value() for k in self.keys]
        if len(set(keys)) != len(keys):
            raise ValueError("flow.keys lists one key twice")
        return self
