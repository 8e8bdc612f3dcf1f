"""The router's HTTP server: the aiohttp application and its listener's lifecycle.

The application's middlewares run outermost first: the connection guard
(:mod:`router.frontends.http.listener`), the request observer (in-flight count, access log, trace
span), OpenAI-shaped errors, then client keys (:mod:`router.frontends.http.auth`). Its routes are
the HTTP API's and the admin API's. The port is bound before anything else of the router
starts, so a taken one fails fast, and served once everything has; draining closes it to
new connections first.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from aiohttp import web

from router.frontends.http.admin_routes import AdminHttp
from router.frontends.http.auth import ClientAuth
from router.frontends.http.listener import BoundSite, ConnectionGuard, bind
from router.frontends.http.observe import RequestObserver
from router.frontends.http.routes import HttpApi, openai_errors
from router.security import ServerTLS

if TYPE_CHECKING:
    from router.serving.services import Services


class HttpServer:
    """The HTTP API and admin API on one listener (``server.*``, ``tls``)."""

    def __init__(self, services: Services, tracer: Any = None) -> None:
        """``tracer``: an OpenTelemetry tracer for a span per request, or None."""
        self.services = services
        server = services.config.server
        self.connections = ConnectionGuard(
            server.max_connections,
            server.header_timeout_s,
            server.body_timeout_s,
            server.keepalive_timeout_s,
        )
        """Client connections: their cap and timeouts."""
        self.observer = RequestObserver(server.access_log, tracer)
        """Counts requests in flight (for draining) and writes the access log."""
        self.api: HttpApi | None = None
        self.tls: ServerTLS | None = None
        """The listener's TLS (``tls`` on ``http``), once bound."""
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._bound: asyncio.Server | None = None

    def app(self) -> web.Application:
        """The aiohttp application: middlewares and routes."""
        services = self.services
        app = web.Application(
            client_max_size=services.config.limits.max_body_bytes,
            middlewares=[
                self.connections.middleware,
                self.observer.middleware,
                openai_errors,
                ClientAuth(services.credentials, services.metrics.auth_refusals).middleware,
            ],
        )
        self.api = HttpApi(services)
        app.add_routes(self.api.routes())
        app.add_routes(AdminHttp(services.admin, services.live).routes())
        return app

    async def bind(self) -> None:
        """Bind the port (a taken one raises :class:`~router.frontends.http.listener.ListenError`);
        connections wait until :meth:`serve`."""
        config = self.services.config
        ssl_context = None
        if config.tls.on("http"):
            self.tls = ServerTLS(config.tls)
            ssl_context = self.tls.context
        # The connections' protocol and its settings are the listener's (listener.py).
        self._runner = web.AppRunner(self.app(), handler_cancellation=True)
        await self._runner.setup()
        self._bound = await bind(
            config.server.host, config.server.port, self.connections, self._runner, ssl_context
        )

    async def serve(self) -> str:
        """Serve on the bound port; returns its URL."""
        assert self._runner is not None and self._bound is not None
        host, port = self._bound.sockets[0].getsockname()[:2]
        await BoundSite(self._runner, self._bound, f"{host}:{port}").start()
        shown = f"[{host}]" if ":" in host else host
        self.url = f"{'https' if self.tls is not None else 'http'}://{shown}:{port}"
        return self.url

    async def stop_accepting(self) -> None:
        """Refuse new connections; idle keep-alives close, busy ones after their answer."""
        if self._runner is None:
            return
        for site in list(self._runner.sites):
            await site.stop()  # new connections are refused from here on
        server = self._runner.server
        if server is not None and hasattr(server, "pre_shutdown"):
            server.pre_shutdown()  # idle keep-alives close, busy ones after their answer

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._bound is not None:
            self._bound.close()  # never served if start failed after binding
            self._bound = None
