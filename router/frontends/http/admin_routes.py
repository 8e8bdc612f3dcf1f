"""The admin endpoints on the router's HTTP listener (the layer is :mod:`router.admin`).

* ``GET /admin/engines``: every engine's URL, role, state, models, DP ranks, in-flight
  load, index blocks held and share of the index; beside them (``tokenizers``) each
  model pool's tokenizer mode, the path it is on and why;
* ``POST /admin/engines``: add an engine (a body like an ``engines[]`` config entry);
* ``DELETE /admin/engines/{endpoint}``: remove one;
* ``POST /admin/engines/{endpoint}/drain`` and ``.../undrain``.

``{endpoint}`` is ``host:port``. Bad input is a 400 and an unknown engine a 404, in
OpenAI's error form.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from router import admin
from router.frontends.http.body import read_body
from router.frontends.http.routes import error_response
from router.serving.errors import ApiError
from router.serving.parsing import decode_body

if TYPE_CHECKING:
    from router.admin import Admin
    from router.live_config import LiveConfig

_encode = msgspec.json.Encoder().encode


class AdminHttp:
    """Admin handlers bound to one router's admin layer."""

    def __init__(self, layer: Admin, live: LiveConfig) -> None:
        self.admin = layer
        self.live = live

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/admin/engines", self.list),
            web.post("/admin/engines", self.add),
            web.delete("/admin/engines/{endpoint}", self.remove),
            web.post("/admin/engines/{endpoint}/drain", self.drain),
            web.post("/admin/engines/{endpoint}/undrain", self.undrain),
            web.post("/admin/reload", self.reload),
        ]

    async def _call(
        self, request: web.Request, action: Callable[[], Awaitable[Any]], status: int = 200
    ) -> web.Response:
        try:
            self.admin.authorize(request.headers.get("Authorization"), request.remote, "http")
            result = await action()
        except admin.AdminError as err:
            return error_response(ApiError(err.status, err.message))
        return web.Response(body=_encode(result), status=status, content_type="application/json")

    async def list(self, request: web.Request) -> web.Response:
        async def action() -> dict[str, Any]:
            return {"engines": await self.admin.engines(), "tokenizers": self.admin.tokenizers()}

        return await self._call(request, action)

    async def add(self, request: web.Request) -> web.Response:
        async def action() -> dict[str, Any]:
            limits = self.live.current.limits
            try:
                body = await read_body(request)
                entry = decode_body(body, limits.max_json_depth)
            except ApiError as err:
                raise admin.AdminError(err.status, err.message) from None
            return await self.admin.add_engine(entry)

        return await self._call(request, action, status=201)

    async def remove(self, request: web.Request) -> web.Response:
        endpoint = request.match_info["endpoint"]
        return await self._call(request, lambda: self.admin.remove_engine(endpoint))

    async def drain(self, request: web.Request) -> web.Response:
        endpoint = request.match_info["endpoint"]
        return await self._call(request, lambda: self.admin.drain(endpoint))

    async def undrain(self, request: web.Request) -> web.Response:
        endpoint = request.match_info["endpoint"]
        return await self._call(request, lambda: self.admin.undrain(endpoint))

    async def reload(self, request: web.Request) -> web.Response:
        return await self._call(request, self.admin.reload)
