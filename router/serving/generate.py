"""A generation request from its read body to its answer.

The HTTP API (completions, chat, Anthropic Messages, Responses) and gRPC ``Generate``
hand each request whose body they have read and admitted, with its route's engine path
and parser, to :meth:`Generations.serve`: the body is decoded, stripped of the router's
own handoff fields, parsed and checked (:mod:`router.serving.validate`), tokenized and
hashed (:func:`router.serving.intake.prepare`), and forwarded by its plan
(:meth:`~router.serving.forward.Forwarder.forward`) into the front end's
:class:`~router.serving.downstream.Downstream`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec

from router.serving.context import RequestContext
from router.serving.headers import check_headers
from router.serving.intake import Parse, prepare

if TYPE_CHECKING:
    from router.serving.context import Outcome
    from router.serving.downstream import Downstream
    from router.serving.forward import Forwarder
    from router.serving.services import Services

BeforePlan = Callable[[RequestContext], Awaitable[None]]
"""A front end's own step between preparing a request and planning it."""

_encode = msgspec.json.Encoder().encode


class Generations:
    """Serves generation requests whose bodies have been read."""

    def __init__(self, app: Services, forwarder: Forwarder) -> None:
        self.app = app
        self.forwarder = forwarder

    async def serve(
        self,
        sink: Downstream,
        path: str,
        parse: Parse,
        request_id: str,
        body: bytes,
        started: float,
        outcome: Outcome,
        deadline: float | None = None,
        before_plan: BeforePlan | None = None,
    ) -> None:
        """Serve a request of the route at ``path`` (the engine path it is forwarded to),
        whose body ``parse`` reads: parse, decide, forward, relay the answer into
        ``sink``.

        ``deadline`` (``time.monotonic``): how long the request may wait for an engine
        with room (``limits.max_inflight_per_engine``); None: 429 at once.
        ``before_plan`` runs once the request is prepared (tokenized), before planning.
        Raises :class:`~router.serving.errors.ApiError` while nothing has reached ``sink``.
        """
        app = self.app
        limits = app.config.limits
        check_headers(sink.headers)  # gRPC Generate's headers map comes straight here
        body, payload = app.owned.body(body, limits.max_json_depth)  # the bytes forwarded
        ready = await prepare(
            app, request_id, payload, parse, sink.headers, wait_until=deadline, flow=outcome.ticket
        )
        ctx = RequestContext(sink, path, ready.parsed, ready.route, payload, body, started, outcome)
        if before_plan is not None:
            await before_plan(ctx)
        await self.forwarder.forward(ctx)
