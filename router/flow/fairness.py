"""Which flow (tenant) of a priority band is served next.

One interface, one class per policy, one registry line (:data:`FAIRNESS`):

* ``vtc``: the virtual token counter (Sheng et al., "Fairness in Serving Large Language
  Models", OSDI '24): every tenant has a counter of the tokens served to it (prompt +
  output); the band serves the waiting tenant with the smallest counter. A tenant that
  comes back after idling starts at the smallest counter among the waiting ones, so it
  cannot bank credit while away.
* ``round_robin``: waiting tenants in turn.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence

MAX_TENANTS = 4096
"""Tenants a policy remembers while they wait for nothing (then the idle ones go)."""


class Fairness(ABC):
    """Chooses among the flows of a band that have requests waiting."""

    @abstractmethod
    def choose(self, waiting: Sequence[str]) -> str:
        """The tenant to serve next among ``waiting`` (non-empty, in the order the flows
        first queued)."""

    def activated(self, tenant: str, waiting: Collection[str]) -> None:  # noqa: B027 (optional)
        """``tenant``'s flow got a request while it had none; ``waiting``: the others."""

    def charge(self, tenant: str, tokens: float) -> None:  # noqa: B027 (optional)
        """``tokens`` were served to ``tenant`` (a negative number corrects an estimate)."""


class RoundRobin(Fairness):
    """Tenants in turn: the one served longest ago goes next."""

    def __init__(self) -> None:
        self._turn = 0
        self._last: dict[str, int] = {}

    def choose(self, waiting: Sequence[str]) -> str:
        chosen = min(waiting, key=lambda t: self._last.get(t, -1))
        self._turn += 1
        self._last[chosen] = self._turn
        return chosen

    def activated(self, tenant: str, waiting: Collection[str]) -> None:
        if len(self._last) > MAX_TENANTS:  # forget tenants that went away
            self._last = {t: self._last[t] for t in waiting if t in self._last}


class VirtualTokenCounter(Fairness):
    """The tenant with the fewest tokens served goes next."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}

    def choose(self, waiting: Sequence[str]) -> str:
        counters = self.counters
        return min(waiting, key=lambda t: counters.get(t, 0.0))

    def activated(self, tenant: str, waiting: Collection[str]) -> None:
        counters = self.counters
        if len(counters) > MAX_TENANTS:  # forget tenants that went away (they come back
            keep = {*waiting, tenant}  # at the waiting floor anyway)
            counters = self.counters = {t: v for t, v in counters.items() if t in keep}
        if waiting:
            floor = min(counters.get(t, 0.0) for t in waiting)
            counters[tenant] = max(counters.get(tenant, 0.0), floor)

    def charge(self, tenant: str, tokens: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens


FAIRNESS: dict[str, type[Fairness]] = {"vtc": VirtualTokenCounter, "round_robin": RoundRobin}
"""``flow.fairness`` name -> policy."""


def make_fairness(name: str) -> Fairness:
    return FAIRNESS[name]()
