"""Routing policies: the default cost policy and named baselines."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from router.policy.base import Decision, NoCandidates, Policy, RouteRequest, Score
from router.policy.kv_cost import DecodeCostPolicy
from router.policy.registry import POLICIES, POLICY_NAMES, PolicyConfig

if TYPE_CHECKING:
    from router.config import DisaggregationConfig

DEFAULT_POLICY = "latency"


def make_policy(config: PolicyConfig, clock: Callable[[], float] = time.monotonic) -> Policy:
    """Build the policy ``config.name`` names (``router.policy.registry.POLICIES``)."""
    name = DEFAULT_POLICY if config.name == "default" else config.name
    if name not in POLICIES:
        raise ValueError(f"unknown policy {config.name!r}; choose one of {', '.join(POLICIES)}")
    module, _, attr = POLICIES[name].partition(":")
    policy: type[Policy] = getattr(importlib.import_module(module), attr)
    return policy.from_config(config, clock)


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
    "POLICIES",
    "POLICY_NAMES",
    "Decision",
    "NoCandidates",
    "Policy",
    "RouteRequest",
    "Score",
    "make_decode_policy",
    "make_policy",
]
