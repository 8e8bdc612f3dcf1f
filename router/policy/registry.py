"""Routing policies by name, and the ``policy`` section that picks one.

:data:`POLICIES` is what ``policy.name`` and ``--policy`` accept; :class:`PolicyConfig`
holds the name, the parameters the cost policies share, and each policy's own section
(``policy.latency``: router/policy/latency_config.py, ``policy.sglang``:
router/policy/sglang_config.py). :mod:`router.config` nests it as ``policy``.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from router.config_section import Section
from router.policy.latency_config import LatencyPolicyConfig
from router.policy.sglang_config import SGLangCacheAwareConfig

#: Every routing policy ``policy.name`` (``--policy``) accepts, as ``name: "module:Class"``
#: (imported when chosen; ``default`` is an alias of ``latency``). The class builds
#: itself from this section with ``Policy.from_config``; a policy with parameters keeps
#: them in its own field of :class:`PolicyConfig` (as ``sglang`` below), a model in a
#: module beside the policy's (router/policy/sglang_config.py). Adding a policy is its
#: module and one line here (tests/unit/test_policies.py builds each).
POLICIES: dict[str, str] = {
    "kv_cost": "router.policy.kv_cost:KVCostPolicy",
    "latency": "router.policy.latency:LatencyPolicy",
    "round_robin": "router.policy.baselines:RoundRobin",
    "random": "router.policy.baselines:RandomChoice",
    "least_loaded": "router.policy.baselines:LeastLoaded",
    "power_of_two": "router.policy.baselines:PowerOfTwo",
    "session": "router.policy.baselines:Session",
    "cache_aware_sglang": "router.policy.sglang:CacheAwareSGLang",
}
POLICY_NAMES = tuple(POLICIES)


class PolicyConfig(Section):
    """How the router picks an engine."""

    name: str = Field(
        "latency",
        description="Policy name; see `kvroute serve --help`. `default` is `latency` (and "
        "`kv_cost` the previous default).",
    )
    prefill_weight: float = Field(
        2.0,
        ge=0,
        description="`kv_cost`: cost per block of this prompt the engine must compute (not "
        "cached). Counts twice by default: the request waits for it, and so does everything "
        "queued behind it on that engine. `latency`: the most a second of prefill can cost "
        "on a saturated engine (its own second, and what it costs the requests arriving "
        "behind it, measured from the engine's load).",
    )
    queue_weight: float = Field(
        1.0, ge=0, description="Cost per block of prefill already queued on the engine."
    )
    decode_weight: float = Field(
        0.25,
        ge=0,
        description="`kv_cost` (and the decode choice of prefill/decode pools): cost per KV "
        "block held by the engine's decoding requests (`latency` prices decode load with "
        "`latency.slowdown_weight` instead). A quarter "
        "of a prefill block: decoding shares each step with a newcomer rather than queueing "
        "ahead of it, but it is the load a conversation keeps on its engine for every "
        "later turn (tuned with `kvroute simulate` on chat and the Mooncake traces and "
        "checked with `kvroute bench --workload chat`, docs/benchmarks.md).",
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
    running_weight: float = Field(
        0.0, ge=0, description="Block-equivalents of cost per engine-reported running request."
    )
    report_max_age_s: float = Field(
        10.0, gt=0, description="Engine-reported values older than this are ignored."
    )
    offload_weight: float = Field(
        0.8,
        ge=0,
        le=1,
        description="Worth of a block held in the CPU tier (host memory) but not on GPU, "
        "vs a GPU hit (llm-d's cpu 0.8). Before the disk tier existed this weighed every "
        "offloaded block; it still weighs disk blocks when `disk_weight` is unset.",
    )
    disk_weight: float | None = Field(
        0.25,
        ge=0,
        le=1,
        description="Worth of a block held only in a disk, shared-storage or remote tier "
        "(vLLM `STORAGE` or `REMOTE` locality, SGLang `DISK`/`EXTERNAL`) vs a GPU hit "
        "(Dynamo's disk 0.25). null: weigh it as `offload_weight` (one offload tier).",
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
    latency: LatencyPolicyConfig = Field(default_factory=LatencyPolicyConfig)
    session_header: str = Field(
        "x-session-id",
        pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$",
        description="Request header (gRPC: metadata or `headers` entry) holding the session "
        "key of the `session` policy and of the `latency` policy's affinity; without it, "
        "the body's `user` (Anthropic: `metadata.user_id`).",
    )

    @field_validator("session_header")
    @classmethod
    def _lower_header(cls, name: str) -> str:
        return name.lower()

    @field_validator("name")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        if name != "default" and name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
        return name
