"""What a handoff dialect is to the router: one :class:`Handoff` per dialect.

A dialect owns how a split request (a :class:`~router.plan.Plan` with a prefill engine)
reaches its engines: the rewritten bodies of its legs, their order, its retries and its
failure rules. When the router forwards the request itself (HTTP, gRPC ``Generate``) it
calls :meth:`Handoff.serve` with the :class:`Legs` that talk to engines; when a caller
forwards it (gRPC ``Pick``, ext_proc) it asks :meth:`Handoff.directions` what the
request must carry. Dialects are found by name in :mod:`router.handoff.registry`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from router.serving.errors import ApiError
from router.serving.usage import cached_tokens

if TYPE_CHECKING:
    from router.config import DisaggregationConfig
    from router.fleet.load import LoadTracker
    from router.fleet.registry import Engine
    from router.metrics import RouterMetrics
    from router.plan import Plan
    from router.policy.base import Decision
    from router.proxy import UpstreamError
    from router.serving.context import RequestContext
    from router.serving.downstream import Downstream
    from router.serving.usage import UsageTap
    from router.types import EngineKey

#: Names a split's prefill engine (``host:port``) to whatever runs the legs beside the
#: decode engine: llm-d's P/D sidecar, ``kvroute sidecar``.
PREFILLER = "x-prefiller-host-port"
#: Prefill engines a split tries (the planned one, then others) before falling back.
PREFILL_TRIES = 2


class Legs(Protocol):
    """The router's side of a handoff: engines, load, metrics and one-leg requests."""

    metrics: RouterMetrics
    loads: LoadTracker
    disaggregation: DisaggregationConfig
    engine_cidrs: list[str]

    def engine(self, key: EngineKey) -> Engine | None:
        """The engine behind a decision's key (None once it left the fleet)."""
        ...

    async def prefill_leg(
        self, ctx: RequestContext, prefill: Decision, body: bytes
    ) -> tuple[int, dict[str, Any]]:
        """POST ``body`` to the prefill engine and read its JSON answer (UpstreamError)."""
        ...

    async def decode_leg(
        self,
        ctx: RequestContext,
        decode: Decision,
        body: bytes,
        *,
        sink: Downstream | None = None,
        cached_tokens: int | None = None,
        tap: UsageTap | None = None,
        headers: dict[str, str] | None = None,
        upstream_headers: dict[str, str] | None = None,
    ) -> None:
        """Send ``body`` to ``decode`` and relay its answer (into ``sink``, by default the
        client's); UpstreamError while nothing reached the client. ``headers`` go to the
        client, ``upstream_headers`` to the engine."""
        ...

    async def another_prefill(
        self, ctx: RequestContext, plan: Plan, exclude: set[str]
    ) -> Decision | None:
        """The planner's next prefill engine for ``plan`` without ``exclude`` (None: none
        left)."""
        ...

    async def local(self, ctx: RequestContext, decode: Decision, reason: str) -> None:
        """Serve the client's own request on the decode engine alone, saying why."""
        ...

    async def refused(self, ctx: RequestContext, status: int, answer: dict[str, Any]) -> None:
        """An engine refused the request itself (4xx): its answer goes to the client."""
        ...


@dataclass(slots=True)
class Directions:
    """What a request forwarded by a gateway must carry (gRPC ``Pick``, ext_proc)."""

    headers: dict[str, str]
    """Headers for the decode engine."""
    pick: dict[str, Any] = field(default_factory=dict)
    """``PickResponse.handoff`` fields (``dialect`` included)."""


class Handoff(ABC):
    """One KV-transfer dialect."""

    name: ClassVar[str]

    @abstractmethod
    async def serve(self, ctx: RequestContext, plan: Plan, legs: Legs) -> None:
        """Serve a split ``plan`` into ``ctx.sink``. Raises UpstreamError when the decode
        engine failed before the first byte (the router plans again without it)."""

    def directions(self, plan: Plan, prefill: Engine | None) -> Directions:
        """For a gateway: the prefill engine in :data:`PREFILLER` (a sidecar beside the
        decode engine runs the legs), and the dialect's name."""
        assert plan.prefill is not None
        return Directions({PREFILLER: plan.prefill.engine.endpoint}, {"dialect": self.name})

    async def fall_back(
        self, ctx: RequestContext, plan: Plan, legs: Legs, last: UpstreamError | None
    ) -> None:
        """No prefill engine could prefill: the decode engine serves alone, unless
        ``disaggregation.fallback_to_decode`` is off (then the last error's status)."""
        legs.metrics.handoffs.labels(self.name, "prefill_failed").inc()
        if not legs.disaggregation.fallback_to_decode:
            status = last.http_status if last is not None else 502
            raise ApiError(status, "no prefill engine could prefill this request")
        await legs.local(ctx, plan.decode, "prefill_failed")


def prefill_saved(answer: dict[str, Any] | None, prefill: Decision) -> int:
    """What the cache saved a split request, for the client's ``cached_tokens``: the
    prefill leg's own count, or the router's estimate when its answer has none."""
    reported = cached_tokens(answer) if answer is not None else None
    return reported if reported is not None else prefill.cached_tokens
