"""What a shared dependency that may be away (Redis) reports: the error a call raises
while it cannot answer, the counters of those calls, and the listener of availability
transitions.

They are the vocabulary of the shared index's contract (``router/index/base.py`` and
``router/index/remote.py`` export them) and of the Redis client under it
(``router/redis/client.py``), so they live below both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


class IndexUnavailable(RuntimeError):
    """The backend cannot answer now (for example Redis is down); route on load alone.

    ``why`` is a short code for the decision's reason: ``over_budget`` (no answer within
    ``index.redis.budget_ms``), ``unreachable``, ``refused`` (an error answer), ``unavailable``.
    """

    def __init__(self, message: str, why: str = "unavailable") -> None:
        super().__init__(message)
        self.why = why


AvailabilityListener = Callable[[bool, bool], None]
"""Called with (available, data_lost) on every transition. ``data_lost`` is only ever
True on the way back up: the backend may have lost what was written before the outage."""


@dataclass(slots=True)
class RemoteCounters:
    """What a remote backend's calls did, for metrics (never reset)."""

    calls: int = 0
    failures: int = 0
    """Calls that timed out or could not reach the backend."""
    fast_failures: int = 0
    """Calls refused at once because the backend was known to be unreachable."""
    outages: int = 0
    """Transitions from available to unavailable."""
    slow_calls: int = 0
    """Calls over the budget that did not (yet) count as an outage."""
