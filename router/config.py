"""kvroute's configuration: one typed object, loaded from YAML and the environment.

Precedence, lowest first: defaults, the YAML file (``--config``), environment variables
``KVROUTE_<SECTION>__<KEY>`` (``__`` separates nesting levels; values are parsed as
YAML scalars, so ``KVROUTE_POLICY__PREFILL_WEIGHT=2`` is a number), then command-line
flags. Validation happens once at start-up and every error names its field.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core.core_schema import ValidationInfo

ENV_PREFIX = "KVROUTE_"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SGLangCacheAwareConfig(_Section):
    """sglang-router's ``cache_aware`` rule (defaults are its CLI defaults, 0.3.x)."""

    cache_threshold: float = Field(0.3, ge=0, le=1)
    balance_abs_threshold: int = Field(64, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=1)
    max_tree_size: int = Field(
        2**26, gt=0, description="Tokens per engine tree before LRU eviction."
    )
    eviction_interval_s: float = Field(120.0, gt=0)


class PolicyConfig(_Section):
    """How the router picks an engine."""

    name: str = Field("kv_cost", description="Policy name; see `kvroute serve --help`.")
    prefill_weight: float = Field(
        2.0,
        ge=0,
        description="Cost per block of this prompt the engine must compute (not cached). "
        "Counts twice by default: the request waits for it, and so does everything queued "
        "behind it on that engine.",
    )
    queue_weight: float = Field(
        1.0, ge=0, description="Cost per block of prefill already queued on the engine."
    )
    decode_weight: float = Field(
        1.0, ge=0, description="Cost per KV block held by the engine's decoding requests."
    )
    waiting_weight: float = Field(
        0.0,
        ge=0,
        description="Block-equivalents of cost per engine-reported waiting request (use when "
        "other routers share the engines without sharing load).",
    )
    kv_usage_weight: float = Field(
        0.0, ge=0, description="Block-equivalents of cost at 100% engine-reported KV usage."
    )
    report_max_age_s: float = Field(
        10.0, gt=0, description="Engine-reported values older than this are ignored."
    )
    offload_weight: float = Field(
        0.8, ge=0, le=1, description="Worth of a block held only in CPU/disk tiers vs GPU."
    )
    temperature: float = Field(
        0.0, ge=0, description="0 picks the lowest cost; >0 samples softmax over normalised costs."
    )
    provisional_ttl_s: float = Field(
        5.0,
        gt=0,
        description="How long a decision counts as holding the prompt's blocks "
        "before the engine's KV events confirm it (about twice the p99 prefill time).",
    )
    approximate_ttl_s: float = Field(
        120.0, gt=0, description="Lifetime of decision-based entries for engines without KV events."
    )
    sglang: SGLangCacheAwareConfig = Field(default_factory=SGLangCacheAwareConfig)

    @field_validator("name")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        from router.policy import POLICY_NAMES  # the policy package imports this module

        if name != "default" and name not in POLICY_NAMES:
            raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
        return name


class IndexConfig(_Section):
    """Where the KV-block index lives."""

    backend: Literal["memory", "redis"] = Field(
        "memory", description="`memory` (embedded, default) or `redis` (shared by replicas)."
    )
    url: str = Field(
        "redis://127.0.0.1:6379/0", description="Redis URL (`redis://` or `rediss://`)."
    )
    namespace: str = Field("kvroute", min_length=1, description="Prefix of every Redis key.")
    budget_ms: float = Field(
        5.0,
        gt=0,
        description="A Redis call slower than this is abandoned; routing goes on "
        "without the index for that request.",
    )


class IndexerEngineConfig(_Section):
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


class IndexerConfig(_Section):
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


class Config(_Section):
    """Everything ``kvroute serve`` reads."""

    block_size: int = Field(16, gt=0, description="Tokens per KV block; must match the engines.")
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    indexer: IndexerConfig = Field(default_factory=IndexerConfig)


class ConfigError(ValueError):
    """Invalid configuration; the message names every offending field."""


def _format_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(root)"
        lines.append(f"{where}: {err['msg']}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[path[-1]] = value


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Nested overrides from ``KVROUTE_A__B=value`` variables."""
    tree: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name == ENV_PREFIX:
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX) :].split("__") if p]
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        _set_path(tree, path, value)
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
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read configuration file {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"configuration file {path} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"configuration file {path} must hold a mapping at the top level")
        data = loaded or {}
    data = merge(data, env_overrides(os.environ if environ is None else environ))
    if overrides:
        data = merge(data, overrides)
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc)) from None
