"""Routing policies: the default cost policy and named baselines."""

from __future__ import annotations

import time
from collections.abc import Callable

from router.config import PolicyConfig
from router.policy.base import Decision, NoCandidates, Policy, RouteRequest, Score
from router.policy.baselines import LeastLoaded, PowerOfTwo, RandomChoice, RoundRobin, Session
from router.policy.kv_cost import KVCostPolicy
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


__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "Decision",
    "NoCandidates",
    "Policy",
    "RouteRequest",
    "Score",
    "make_policy",
]
