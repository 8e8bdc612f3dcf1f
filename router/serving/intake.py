"""Intake: a request's body, as every front end has it, made ready to plan.

A front end maps its transport to a decoded body, a parser for its route and the headers
that carry routing hints, and calls :func:`prepare`: the body is parsed (400 for what
routing cannot read), checked (:func:`~router.serving.validate.check_request`: the model,
``max_tokens``, ``n``), tokenized and hashed with its SLOs
(:meth:`~router.serving.decide.Decider.prepare`), and its prompt checked against the model's
length (:func:`~router.serving.validate.check_prompt_tokens`). Refusals are
:class:`~router.serving.errors.ApiError` values that each front end writes in its own form.
Before it, the body is decoded and the router-owned fields taken out by the one rule of
:mod:`router.serving.owned` (a front end that cannot change the body it forwards,
``Pick`` or ext_proc once chunks have gone on, refuses them by the same rule).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.serving.validate import check_prompt_tokens, check_request

if TYPE_CHECKING:
    from router.flow.ticket import FlowTicket
    from router.policy.base import RouteRequest
    from router.serving.parsing import ParsedRequest
    from router.serving.services import Services

Parse = Callable[[dict[str, Any]], "ParsedRequest"]
"""A route's parser: a decoded body's routing facts (400 for what routing cannot read)."""


@dataclass(slots=True, eq=False)
class Prepared:
    """A request ready to plan: what the body asks, and its routing facts."""

    parsed: ParsedRequest
    route: RouteRequest
    model: str
    """The model it names (checked: the registry serves it)."""

    @property
    def load_tokens(self) -> int:
        """The prompt tokens it puts on an engine: every prompt, ``n`` times."""
        return sum(len(p) for p in self.parsed.prompts) * self.parsed.n


async def prepare(
    app: Services,
    request_id: str,
    payload: dict[str, Any],
    parse: Parse,
    hints: Mapping[str, str],
    *,
    session: str | None = None,
    wait_until: float | None = None,
    flow: FlowTicket | None = None,
) -> Prepared:
    """Parse, check, tokenize and hash ``payload`` (a decoded body) for planning.

    ``hints``: the headers (or metadata) carrying the session and SLO headers;
    ``session``: one the transport gives itself (else the session header's);
    ``wait_until``: how long it may wait for an engine with room (None: 429 at once);
    ``flow``: its flow-control ticket. Raises :class:`~router.serving.errors.ApiError`.
    """
    limits = app.config.limits
    decider = app.decider
    parsed = parse(payload)
    model = check_request(parsed, limits, app.registry.models())
    parsed.model = model
    if session is None:
        session = decider.session_of(hints)
    route = await decider.prepare(request_id, model, parsed, session, hints)
    check_prompt_tokens(parsed, limits)
    route.wait_until = wait_until
    route.flow = flow
    return Prepared(parsed, route, model)
