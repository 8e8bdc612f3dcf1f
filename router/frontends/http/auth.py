"""Client keys on the HTTP listener (``auth.*``, docs/security.md).

The client API (``/v1/*`` and the engine routes outside it), and ``/metrics`` when
``auth.metrics_need_key`` says so, need a client key (``x-api-key`` where
``auth.accept_x_api_key`` takes it); a refusal is counted in
``kvroute_auth_refusals_total`` and answered in the route's error form with
``WWW-Authenticate``. Admin calls are checked by the admin layer; probes and the OpenAPI
document stay open. The keys are the :class:`~router.security.Credentials` in force
(a reload re-reads them in place).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from router.frontends.http.engine_routes import is_client_path
from router.frontends.http.routes import error_response
from router.security import AuthError
from router.serving.errors import ApiError

if TYPE_CHECKING:
    from prometheus_client import Counter

    from router.security import Credentials


class ClientAuth:
    """The HTTP middleware that checks client keys."""

    def __init__(self, credentials: Credentials, refusals: Counter) -> None:
        """``refusals`` is ``kvroute_auth_refusals_total`` (api, kind, status)."""
        self.credentials = credentials
        self.refusals = refusals

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        path = request.path
        if is_client_path(path) or (path == "/metrics" and self.credentials.metrics_need_key):
            try:
                self.credentials.check_http(request.headers, path)
            except AuthError as exc:
                self.refusals.labels("http", "client", str(exc.status)).inc()
                return error_response(
                    ApiError(exc.status, exc.message, code="invalid_api_key"),
                    None,
                    extra_headers={"WWW-Authenticate": 'Bearer realm="kvroute"'},
                    path=path,
                )
        return await handler(request)
