"""How full a model's pool is, in [0, 1], from what the router knows.

Per engine (routing target), the largest of: its reported KV-cache usage, its reported
waiting requests over ``engine_waiting``, the uncached prompt tokens the router has
queued there over ``engine_queued_tokens``, and its in-flight requests over
``engine_inflight`` (or ``limits.max_inflight_per_engine`` when set), each capped at 1.
The pool's value is the mean over its healthy engines, raised to the share of the
admission queue its requests fill (waiting over ``queue_waiting``) when that is larger.
A pool without a healthy engine is saturated (1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from router.fleet.load import load_of

if TYPE_CHECKING:
    from router.fleet.load import LoadTracker
    from router.fleet.registry import Registry
    from router.flow.config import FlowSaturationConfig

ALL_ROLES = ("both", "prefill", "decode")


def engine_saturation(
    config: FlowSaturationConfig,
    *,
    kv_usage: float | None,
    waiting: float | None,
    queued_tokens: int,
    inflight: int,
    inflight_limit: int,
) -> float:
    """One engine's saturation (pure: every input is given)."""
    parts = [
        kv_usage or 0.0,
        (waiting or 0.0) / config.engine_waiting,
        max(queued_tokens, 0) / config.engine_queued_tokens,
        max(inflight, 0) / inflight_limit,
    ]
    return min(1.0, max(0.0, *parts))


def pool_saturation(engines: Iterable[float], queued: int, queue_waiting: int) -> float:
    """A pool's saturation from its engines' values and its requests waiting in the queue."""
    values = list(engines)
    if not values:
        return 1.0
    return min(1.0, max(sum(values) / len(values), queued / queue_waiting))


class Saturation:
    """Computes ``kvroute_pool_saturation`` per model from the registry and the load view."""

    def __init__(
        self,
        config: Callable[[], FlowSaturationConfig],
        registry: Registry,
        loads: LoadTracker,
        max_per_engine: Callable[[], int],
        queued: Callable[[str], int],
    ) -> None:
        self.config = config
        self.registry = registry
        self.loads = loads
        self.max_per_engine = max_per_engine
        self.queued = queued
        """Requests of a (base) model waiting in the admission queue."""

    def of(self, model: str | None) -> float:
        """The saturation of ``model``'s pool (None: the only pool, or the fullest)."""
        if model is None:
            models = self.registry.models()
            return max((self.of(m) for m in models), default=1.0)
        cfg = self.config()
        base = self.registry.base_of(model)
        view = self.loads.view
        limit = self.max_per_engine() or cfg.engine_inflight
        values = [
            engine_saturation(
                cfg,
                kv_usage=load.kv_usage,
                waiting=load.waiting,
                queued_tokens=load.prefill_tokens,
                inflight=load.requests,
                inflight_limit=limit,
            )
            for key in self.registry.candidates(base, ALL_ROLES)
            for load in (load_of(view, key),)
        ]
        return pool_saturation(values, self.queued(base), cfg.queue_waiting)

    def all(self) -> dict[str, float]:
        """Every served base model's saturation."""
        bases = sorted({self.registry.base_of(m) for m in self.registry.models()})
        return {m: self.of(m) for m in bases}
