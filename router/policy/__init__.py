"""Routing policies: the default cost policy and named baselines."""

from __future__ import annotations

import time
from collections.abc import Callable

from router.config import DisaggregationConfig, PolicyConfig
from router.policy.base import Decision, NoCandidates, Policy, RouteRequest, Score
from router.policy.baselines import LeastLoaded, PowerOfTwo, RandomChoice, RoundRobin, Session
from router.policy.kv_cost import DecodeCostPolicy, KVCostPolicy
from router.policy.sglang import CacheAwareSGLang

#: Every policy name ``--policy`` accepts; ``default`` is an alias of ``kv_cost``.
POLICY_NAMES = (
    "kv_cost",
    "round_robin",
    "random",
    "least_loaded",
    "power_of_two",
    "session",
    "cache_aware_sglang",
)
DEFAULT_POLICY = "kv_cost"


def make_policy(config: PolicyConfig, clock: Callable[[], float] = time.monotonic) -> Policy:
    """Build the policy ``config.name`` names."""
    name = DEFAULT_POLICY if config.name == "default" else config.name
    if name == "kv_cost":
        return KVCostPolicy(config, clock)
    if name == "cache_aware_sglang":
        return CacheAwareSGLang(config.sglang, clock)
    simple: dict[str, Callable[[], Policy]] = {
        "round_robin": RoundRobin,
        "random": RandomChoice,
        "least_loaded": LeastLoaded,
        "power_of_two": PowerOfTwo,
        "session": Session,
    }
    if name not in simple:
        raise ValueError(f"unknown policy {config.name!r}; choose one of {', '.join(POLICY_NAMES)}")
    return simple[name]()


def make_decode_policy(
    config: PolicyConfig,
    disaggregation: DisaggregationConfig,
    router_policy: Policy,
    clock: Callable[[], float] = time.monotonic,
) -> Policy:
    """The policy that picks decode engines of a disaggregated pool.

    Cache-aware routers choose decode engines by their own cost, with the engines'
    reported KV usage and running/waiting requests weighed by the ``disaggregation``
    decode weights; a baseline policy (round_robin, random, ...) chooses both legs,
    each leg with its own instance so that, e.g., round robin rotates prefill and decode
    engines independently.
    """
    if router_policy.uses_index:
        return DecodeCostPolicy.for_disaggregation(
            config,
            disaggregation.decode_weight,
            disaggregation.decode_queue_weight,
            disaggregation.decode_prefix_weight,
            clock,
            waiting_weight=disaggregation.decode_waiting_weight,
            running_weight=disaggregation.decode_running_weight,
            kv_usage_weight=disaggregation.decode_kv_usage_weight,
        )
    return make_policy(config, clock)


__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "Decision",
    "NoCandidates",
    "Policy",
    "RouteRequest",
    "Score",
    "make_decode_policy",
    "make_policy",
]
