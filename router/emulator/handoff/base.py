"""What every handoff dialect provides to a generation request, and how it fails."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from router.engine_model import RequestOutput, RequestSpec

if TYPE_CHECKING:
    from router.emulator.config import EmulatorConfig
    from router.emulator.state import Rank

#: Runs a coroutine in the background, owned by the server (stopped with it).
Spawn = Callable[[Coroutine[Any, Any, None]], None]

#: Wall seconds a side-channel or bootstrap exchange may take before it is a failure.
RPC_TIMEOUT_S = 10.0


class HandoffFailed(Exception):
    """A KV handoff that did not happen; the request fails or recomputes."""

    def __init__(self, dialect: str, reason: str, message: str) -> None:
        super().__init__(message)
        self.dialect = dialect
        self.reason = reason
        self.message = message


@dataclass
class Leg:
    """The one sequence of a request taking part in a handoff, and where it runs."""

    rank: Rank
    config: EmulatorConfig
    #: The sequence as it would run without a handoff.
    spec: RequestSpec
    spawn: Spawn


class Handoff:
    """One request's part in a handoff. The generation calls, in order:

    ``prepare`` before submitting (a decode leg obtains its KV here), ``first_output``
    and ``finished`` as the sequence progresses, ``close`` however the request ends.
    """

    dialect: ClassVar[str]
    #: The sequence keeps its blocks after finishing (a prefill leg).
    remote_decode: ClassVar[bool] = False
    #: Output length forced on the leg (None: as the client asked).
    max_tokens: ClassVar[int | None] = None

    def __init__(self, leg: Leg) -> None:
        self.leg = leg
        #: The ``x-kvroute-handoff`` header: ``pulled=N``, ``recomputed=N`` or
        #: ``failed=<reason>``.
        self._header: str | None = None

    async def prepare(self) -> bool:
        """Get ready to run; True when the prompt's KV arrives from a prefill engine.

        Raises ``HandoffFailed`` when the request must fail.
        """
        return False

    def first_output(self, out: RequestOutput) -> None:
        """The sequence produced its first token (any KV transfer is complete)."""

    def finished(self, out: RequestOutput) -> None:
        """The sequence finished (``out.held`` set for a prefill leg)."""

    def params(self) -> dict[str, Any] | None:
        """``kv_transfer_params`` for the response body."""
        return None

    def header(self) -> str | None:
        """The ``x-kvroute-handoff`` response header: what the decode leg did."""
        return self._header

    def close(self) -> None:
        """The request is over (finished, failed or abandoned): let go of the peer."""

    def fail(self, reason: str, message: str) -> HandoffFailed:
        """Count a failure of this dialect on this rank and make its exception."""
        self.leg.rank.metrics.handoff_failed(self.dialect, reason)
        self._header = f"failed={reason}"
        return HandoffFailed(self.dialect, reason, message)
