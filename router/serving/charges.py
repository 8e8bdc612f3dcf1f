"""The load a plan's legs put on their engines: one rule for every caller.

A request's engines carry its work in the load tracker from the moment it is sent until
it ends (:class:`~router.fleet.load.LoadTracker`). Which tickets a plan opens is the
same whoever forwards the request: the handoff dialects and the HTTP prefill leg, a
gateway's pick (gRPC ``Pick``, ext_proc) and the cluster simulator all take their
charges from here, so that an engine's load looks the same to the next decision
whichever path routed the request.

* The engine serving the whole request counts every prompt (the plan's
  ``load_tokens``: all prompts, times ``n``) less what it has cached, the request's
  output tokens, and its flow ticket.
* A split's decode leg counts the same prompts, but all of the prompt except its last
  token as cached: the KV is pulled from the prefill engine, not prefilled. Its flow
  ticket stays with the prefill leg, and its first token times another engine's
  prefill, not its own (``timed`` False).
* A split's prefill leg counts the routing prompt less the prefill engine's cached
  tokens, one output token, and the request's flow ticket.

Callers keep only what is theirs: whether they will see a leg's first token
(``sees_first_token``), and when each leg's ticket begins and ends.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.fleet.load import LoadTracker, Ticket
    from router.flow.ticket import FlowTicket
    from router.plan import Plan
    from router.policy.base import Decision, RouteRequest
    from router.types import EngineKey

#: Output tokens a split's prefill leg generates (the dialects ask for one).
PREFILL_OUTPUT_TOKENS = 1


def pulled_cached_tokens(prompt_tokens: int) -> int:
    """Prompt tokens a split's decode leg counts as cached: all but the last, whose KV
    it computes itself after pulling the rest."""
    return max(prompt_tokens - 1, 0)


@dataclass(frozen=True, slots=True)
class LegCharge:
    """What one leg of a plan adds to its engine's load while it runs."""

    engine: EngineKey
    prompt_tokens: int
    cached_tokens: int
    max_tokens: int
    flow: FlowTicket | None = None
    """The request's flow ticket, on the leg that prefills it (prefill isolation)."""
    timed: bool | None = None
    """Whether its first token times the engine's own prefill (None: when its first token
    is seen; False: another engine prefilled it)."""

    def begin(self, loads: LoadTracker, *, sees_first_token: bool = True) -> Ticket:
        """Open the leg's ticket on ``loads``. ``sees_first_token``: the caller will
        report the first token when it arrives (a streamed answer), rather than only the
        end (a gateway's pick, a whole answer)."""
        return loads.begin(
            self.engine,
            self.prompt_tokens,
            self.cached_tokens,
            self.max_tokens,
            self.flow,
            sees_first_token=sees_first_token,
            timed=self.timed,
        )

    def on(self, engine: EngineKey) -> LegCharge:
        """The same leg served by ``engine`` instead, with nothing known cached there (a
        gateway that sent the request elsewhere)."""
        return replace(self, engine=engine, cached_tokens=0)


def prefill_charge(route: RouteRequest, prefill: Decision) -> LegCharge:
    """A split's prefill leg on the ``prefill`` engine (the planned one or a retry's)."""
    return LegCharge(
        prefill.engine,
        route.prompt_tokens,
        prefill.cached_tokens,
        PREFILL_OUTPUT_TOKENS,
        route.flow,
    )


def decode_charge(
    route: RouteRequest, decode: Decision, load_tokens: int, *, split: bool
) -> LegCharge:
    """The engine serving the request: the whole of it, or a split's decode leg."""
    if not split:
        return LegCharge(
            decode.engine, load_tokens, decode.cached_tokens, route.max_tokens, route.flow
        )
    return LegCharge(
        decode.engine,
        load_tokens,
        pulled_cached_tokens(route.prompt_tokens),
        route.max_tokens,
        timed=False,
    )


@dataclass(frozen=True, slots=True)
class Charges:
    """Every leg of one plan, as it charges its engine's load."""

    decode: LegCharge
    """The engine serving the request (the decode leg when split)."""
    prefill: LegCharge | None = None
    """The prefill leg, when split."""

    @classmethod
    def of(cls, plan: Plan) -> Charges:
        """The charges of ``plan``'s legs."""
        route, split = plan.route, plan.prefill is not None
        return cls(
            decode_charge(route, plan.decode, plan.load_tokens, split=split),
            prefill_charge(route, plan.prefill) if plan.prefill is not None else None,
        )

    def begin(
        self, loads: LoadTracker, *, sees_first_token: bool = True
    ) -> tuple[Ticket, Ticket | None]:
        """Open every leg's ticket, the prefill leg's first (it runs first): the decode
        ticket and the prefill ticket (None when not split)."""
        prefill = (
            self.prefill.begin(loads, sees_first_token=sees_first_token)
            if self.prefill is not None
            else None
        )
        return self.decode.begin(loads, sees_first_token=sees_first_token), prefill
