"""One generation request on its way through the router (HTTP and gRPC ``Generate``).

Everything the forwarding code and the handoff strategies read about the request
travels in one :class:`RequestContext`, and what finally happened to it in its
:class:`Outcome`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from router.flow.ticket import FlowTicket
    from router.policy.base import RouteRequest
    from router.serving.downstream import Downstream
    from router.serving.errors import ApiError
    from router.serving.parsing import ParsedRequest
    from router.types import EngineKey


class AnswerWatch(Protocol):
    """Sees an engine's successful answer on its way to the client (never changes it)."""

    async def answer(self, body: bytes) -> None:
        """A whole JSON answer."""

    async def chunk(self, chunk: bytes) -> None:
        """Part of a stream, in order."""


class Outcome:
    """What finally happened to one request, for the requests metric."""

    __slots__ = ("outcome", "status", "ticket", "usage")

    def __init__(self) -> None:
        self.outcome = "cancelled"
        self.status = 499
        self.ticket: FlowTicket | None = None
        """Its flow-control ticket (``flow.enabled``): its wait goes into
        ``x-kvroute-reason``."""
        self.usage: dict[str, Any] | None = None
        """The answer's ``usage``, once seen (flow control corrects token estimates)."""

    def reason(self, summary: str) -> str:
        """``x-kvroute-reason``: the decision's ``summary``, and the queue's part."""
        return summary if self.ticket is None else f"{summary}; {self.ticket.describe()}"

    def set(self, outcome: str, status: int) -> None:
        self.outcome, self.status = outcome, status

    def failed(self, err: ApiError) -> None:
        """The request ended with ``err`` before any answer."""
        if err.status == 429:
            self.set("rejected", 429)
        else:
            self.set("client_error" if err.status < 500 else server_outcome(err.status), err.status)


def server_outcome(status: int) -> str:
    """The outcome label of a server-side failure status."""
    return {502: "engine_error", 503: "no_engine", 504: "timeout"}.get(status, "engine_error")


@dataclass(slots=True, eq=False)
class RequestContext:
    """A parsed, prepared generation request and where its answer goes."""

    sink: Downstream
    """Where the answer goes (the HTTP client, or a gRPC ``Generate`` stream)."""
    path: str
    """The engine path it is forwarded to (``/v1/completions``, ``/v1/chat/completions``)."""
    parsed: ParsedRequest
    request: RouteRequest
    """Its routing facts (request id, block keys, prompt length, admission deadline)."""
    payload: dict[str, Any]
    """The decoded body, without router-owned handoff fields."""
    body: bytes
    """The bytes forwarded to an engine that serves the whole request."""
    started: float
    """``time.perf_counter()`` when the request arrived."""
    outcome: Outcome = field(default_factory=Outcome)
    subset: Collection[str] | None = None
    """The engines (endpoints) that may serve it, e.g. the one holding the conversation
    it continues; None: any candidate."""
    watch: Callable[[EngineKey], AnswerWatch] | None = None
    """Makes what sees the answer of the engine serving it (Responses: learns its id)."""

    @property
    def model(self) -> str:
        model = self.parsed.model
        assert model is not None, "the model is resolved before a request is planned"
        return model

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def load_tokens(self) -> int:
        """Prompt tokens the serving engine's load counts: every prompt, times ``n``."""
        return sum(len(p) for p in self.parsed.prompts) * self.parsed.n
