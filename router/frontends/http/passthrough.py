"""Every other engine route, passed through: embeddings, pooling, score, rerank,
classify, tokenize, detokenize, render... (the table is :mod:`router.frontends.http.engine_routes`).

One handler serves them all, on the request path of completions with its prompt steps
left out: the router admits the request and reads its body (``limits.max_body_bytes``,
``server.body_timeout_s``), decodes it (``limits.max_json_depth``), resolves its
``model`` as completions do (:func:`~router.serving.validate.resolve_model`: 404 for a model
no engine serves, 400 when several are served and none is named), then asks the
planner for an engine among the healthy ones serving that model, by the routing policy
on load alone: nothing is tokenized or hashed. The original bytes go to that engine;
its answer, whatever its status, comes back as it is, a stream chunk by chunk. A
failure before the first byte is retried on another engine, as for completions; what
the router refuses itself is OpenAI error JSON. Client keys apply as on ``/v1/*``
(:func:`~router.frontends.http.engine_routes.is_client_path`).

The routes of :data:`~router.frontends.http.engine_routes.NOT_ROUTED` are answered here too, with
their documented 404.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from router.frontends.http.engine_routes import EngineRoute, NotRouted, not_routed
from router.policy.base import RouteRequest
from router.serving.context import Outcome, RequestContext
from router.serving.errors import bad_request
from router.serving.parsing import ParsedRequest
from router.serving.validate import resolve_model

if TYPE_CHECKING:
    from router.serving.downstream import Downstream
    from router.serving.forward import Forwarder
    from router.serving.services import Services

log = logging.getLogger("kvroute.http")

_encode = msgspec.json.Encoder().encode
_BYTES_PER_TOKEN = 4
"""The load estimate of a body the engine runs through its model: a token per four
bytes (nothing is tokenized on this path)."""


def refusing(route: NotRouted) -> Any:
    """The handler of a route of :data:`NOT_ROUTED`: its documented 404."""

    async def handler(request: web.Request) -> web.StreamResponse:
        raise not_routed(route)

    return handler


class Passthrough:
    """Serves the requests of :data:`ENGINE_ROUTES` (the HTTP API admits them and reads
    their bodies: :meth:`~router.frontends.http.routes.HttpApi.routes`)."""

    def __init__(self, app: Services, forwarder: Forwarder) -> None:
        self.app = app
        self.forwarder = forwarder

    async def handle(
        self,
        route: EngineRoute,
        sink: Downstream,
        label: str,
        request_id: str,
        body: bytes,
        started: float,
        outcome: Outcome,
        deadline: float | None = None,
    ) -> None:
        """Serve one request of ``route`` whose body has been read (raises
        :class:`ApiError` while nothing has reached ``sink``); ``label`` is the metrics
        label the HTTP API counts it under."""
        app = self.app
        # Owned fields hide in e.g. sampling_params.extra_args on generate.
        body, payload = app.owned.body(body, app.config.limits.max_json_depth)
        requested = payload.get("model")
        if requested is not None and not isinstance(requested, str):
            raise bad_request("'model' must be a string", "model")
        model = resolve_model(requested, app.registry.models())
        stream = route.streams and payload.get("stream") is True
        tokens = len(body) // _BYTES_PER_TOKEN if route.model_work else 0
        route_request = RouteRequest(
            request_id,
            [],
            tokens,
            app.block_size_for(app.registry.base_of(model)),
            session=app.decider.session_of(sink.headers),
            wait_until=deadline,
            by_load=True,
        )
        parsed = ParsedRequest(model, stream, None, 1, None, None, include_usage=False)
        parsed.prompts = [[]]
        ctx = RequestContext(
            sink, route.path, parsed, route_request, payload, body, started, outcome
        )
        await self.forwarder.by_load(ctx)
