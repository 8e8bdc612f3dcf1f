"""The planner's wiring: the decode policy and the :class:`~router.plan.Planner` from
configuration, the same for the router and the simulator.

The router (:class:`~router.serving.decide.Decider`, at start and on a reload) and each
simulated router replica (:class:`~router.sim.cluster.ClusterSim`) bring their own
pools, routing core and hooks (the admission wait, the split counter, the topology);
what the configuration makes of them is decided here once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from router.config import DisaggregationConfig, PolicyConfig
from router.core import RoutingCore
from router.plan import Planner, Pools, WaitForRoom, refuse
from router.policy import make_decode_policy
from router.policy.disagg import SplitDecision
from router.topology import Topology
from router.types import EngineKey


def wire_planner(
    pools: Pools,
    core: RoutingCore,
    policy: PolicyConfig,
    disaggregation: DisaggregationConfig,
    dialect_of: Callable[[str], str],
    *,
    clock: Callable[[], float] = time.monotonic,
    wait: WaitForRoom = refuse,
    on_split: Callable[[SplitDecision], None] | None = None,
    locate: Callable[[EngineKey], Topology | None] | None = None,
) -> Planner:
    """The planner over ``pools`` and ``core``, with the decode policy the ``policy`` and
    ``disaggregation`` sections give for the core's policy (its
    :attr:`~router.plan.Planner.decode_policy`). ``dialect_of``: a model's handoff
    dialect; ``clock``: the decode policy's; ``wait``, ``on_split``, ``locate``: as
    :class:`~router.plan.Planner` takes them."""
    decode_policy = make_decode_policy(policy, disaggregation, core.policy, clock)
    return Planner(
        pools,
        core,
        decode_policy,
        disaggregation,
        dialect_of,
        wait=wait,
        on_split=on_split,
        locate=locate,
    )
