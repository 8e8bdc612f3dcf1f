"""The engine routes beside completions and chat: which pass through, and which do not.

Every line of :data:`ENGINE_ROUTES` is a vLLM 0.32 route that kvroute forwards to an
engine serving the body's ``model``, chosen by the routing policy on load alone (no
prompt is hashed: these answers fill no prefix cache a later request could reuse), with
the auth, limits, metrics, retries and error handling of completions
(:mod:`router.frontends.http.passthrough`). Adding one is a line here.

The lines of :data:`NOT_ROUTED` are engine routes kvroute answers itself with a 404 in
OpenAI's form that says why (:func:`not_routed`): admin calls that belong to one engine,
WebSockets, multipart uploads. Any other path is an unknown route (:func:`unknown_route`).
"""

from __future__ import annotations

from dataclasses import dataclass

from router.serving.errors import ApiError


@dataclass(frozen=True, slots=True)
class EngineRoute:
    """A ``POST`` route with a JSON body that passes through to one engine."""

    path: str
    label: str
    """Its ``route`` label on ``kvroute_requests_total`` (one per family)."""
    streams: bool = False
    """A body with ``"stream": true`` is answered with server-sent events, relayed chunk
    by chunk; otherwise the answer is read whole."""
    model_work: bool = True
    """The engine runs the body through the model, so the engine's load counts it as
    prefill work (estimated from the body's size); False: tokenizer-only work
    (tokenize, render), counted as a request in flight alone."""


#: Routed on load among the engines serving the body's ``model``.
ENGINE_ROUTES: tuple[EngineRoute, ...] = (
    EngineRoute("/v1/embeddings", "embeddings"),
    EngineRoute("/v2/embed", "embeddings"),  # Cohere's embed API
    EngineRoute("/pooling", "pooling"),
    EngineRoute("/classify", "classify"),
    EngineRoute("/score", "score"),
    EngineRoute("/v1/score", "score"),
    EngineRoute("/rerank", "rerank"),
    EngineRoute("/v1/rerank", "rerank"),
    EngineRoute("/v2/rerank", "rerank"),
    EngineRoute("/tokenize", "tokenize", model_work=False),
    EngineRoute("/detokenize", "detokenize", model_work=False),
    EngineRoute("/v1/completions/render", "render", model_work=False),
    EngineRoute("/v1/chat/completions/render", "render", model_work=False),
    # Render routes of the Responses and Messages APIs: vLLM's scale-out routes with
    # OpenAI-shaped errors, so they pass through like the other two.
    EngineRoute("/v1/responses/render", "render", model_work=False),
    EngineRoute("/v1/messages/render", "render", model_work=False),
    EngineRoute("/v1/completions/derender", "derender", model_work=False),
    EngineRoute("/v1/chat/completions/derender", "derender", model_work=False),
    EngineRoute("/v1/chat/completions/batch", "chat_batch"),
    EngineRoute("/inference/v1/generate", "generate_tokens", streams=True),
    EngineRoute("/generative_scoring", "generative_scoring"),
    EngineRoute("/v1/systemone", "structured_decisions"),
)


@dataclass(frozen=True, slots=True)
class NotRouted:
    """An engine route kvroute deliberately does not forward."""

    method: str
    path: str
    why: str
    """The end of the refusal's message: what to do instead."""


_ADAPTERS = (
    "an adapter is loaded on each engine itself (kvroute then routes the adapter's name "
    "to the engines whose /v1/models list it): call each engine directly"
)
_UPLOADS = "kvroute routes JSON bodies; multipart/form-data uploads go to an engine directly"
_ABORT = (
    "it names the engine's own request ids, which only the engine running them knows; "
    "kvroute aborts a request on its engine when the client disconnects"
)

#: Answered 404 ``route_not_routed`` by the router, with the reason.
NOT_ROUTED: tuple[NotRouted, ...] = (
    NotRouted("POST", "/v1/load_lora_adapter", _ADAPTERS),
    NotRouted("POST", "/v1/unload_lora_adapter", _ADAPTERS),
    NotRouted(
        "GET",
        "/v1/realtime",
        "it is a WebSocket session and kvroute does not proxy WebSockets: connect to an "
        "engine directly",
    ),
    NotRouted("POST", "/v1/audio/transcriptions", _UPLOADS),
    NotRouted("POST", "/v1/audio/translations", _UPLOADS),
    NotRouted("POST", "/inference/v1/abort_requests", _ABORT),
    NotRouted("POST", "/abort_requests", _ABORT),
)

#: Client API paths outside ``/v1/``: client keys apply to them as to ``/v1/*``.
CLIENT_PATHS: frozenset[str] = frozenset(
    path
    for path in (*(r.path for r in ENGINE_ROUTES), *(n.path for n in NOT_ROUTED))
    if not path.startswith("/v1/")
)


def is_client_path(path: str) -> bool:
    """Whether ``path`` belongs to the client API (auth, access log): ``/v1/*`` and the
    engine routes outside it."""
    return path.startswith("/v1/") or path in CLIENT_PATHS


def not_routed(route: NotRouted) -> ApiError:
    """The router's answer to a route it does not forward."""
    return ApiError(
        404,
        f"kvroute does not route {route.method} {route.path}: {route.why}",
        code="route_not_routed",
    )


def unknown_route(method: str, path: str) -> ApiError:
    """The router's answer to a path it serves no route for (no proxy guess)."""
    return ApiError(
        404,
        f"kvroute serves no route {method} {path[:200]}: its routes are listed in the "
        "README and GET /openapi.json (an engine's own admin routes are called on each "
        "engine directly)",
        code="unknown_route",
    )
