"""What every HTTP request goes through first: in-flight count, access log, trace span.

One aiohttp middleware, outermost, so it sees the final answer (errors included) and the
headers the router put on it: ``x-request-id``, ``x-kvroute-engine``,
``x-kvroute-prefill``, ``x-kvroute-mode`` and ``x-kvroute-reason``. It costs a counter
and a set insertion per request when access logging and tracing are off.

* **Draining** waits for :meth:`RequestObserver.wait_idle` (streams included) and cancels
  what is left at the deadline with :meth:`RequestObserver.cancel_all`.
* **Access log**: one record per API request on the ``kvroute.access`` logger, at info
  level with ``server.access_log`` on, at debug level otherwise; its fields go into JSON
  logs as keys (``request_id``, ``status``, ``duration_ms``, ``engine``, ...).
* **Tracing** (when configured): a server span per request that continues the caller's
  ``traceparent``, with the decision's engine and reason as attributes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from router.frontends.http.engine_routes import is_client_path

access_log = logging.getLogger("kvroute.access")

#: Response headers copied into the access log and span attributes.
_FIELDS = (
    ("x-kvroute-engine", "engine"),
    ("x-kvroute-prefill", "prefill_engine"),
    ("x-kvroute-mode", "mode"),
    ("x-kvroute-reason", "reason"),
)


class RequestObserver:
    """Counts in-flight requests and logs or traces each one."""

    def __init__(self, access_log_info: bool = False, tracer: Any = None) -> None:
        self.access_log_info = access_log_info
        """Access log at info level (``server.access_log``); else at debug level."""
        self.tracer = tracer
        """An OpenTelemetry tracer, or None."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def inflight(self) -> int:
        """Requests being served now (streams count until their last byte)."""
        return len(self._tasks)

    async def wait_idle(self, timeout: float) -> int:
        """Wait until no request is in flight or ``timeout`` passed; returns those left."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return self.inflight

    def cancel_all(self) -> None:
        """Cancel every in-flight request (the client sees its stream end)."""
        for task in list(self._tasks):
            task.cancel()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._idle.clear()
        try:
            if self.tracer is not None:
                return await self._traced(request, handler)
            if not is_client_path(request.path):
                return await handler(request)
            level = logging.INFO if self.access_log_info else logging.DEBUG
            if not access_log.isEnabledFor(level):
                return await handler(request)
            started = time.perf_counter()
            response = await handler(request)
            self._log(level, request, response, started)
            return response
        finally:
            self._tasks.discard(task)
            if not self._tasks:
                self._idle.set()

    def _log(
        self, level: int, request: web.Request, response: web.StreamResponse, started: float
    ) -> None:
        headers = response.headers
        fields: dict[str, Any] = {
            "request_id": headers.get("x-request-id") or request.headers.get("x-request-id"),
            "method": request.method,
            "path": request.path,
            "status": response.status,
            "duration_ms": round((time.perf_counter() - started) * 1000, 3),
        }
        for header, name in _FIELDS:
            value = headers.get(header)
            if value is not None:
                fields[name] = value
        text = " ".join(f"{k}={v}" for k, v in fields.items() if k not in ("method", "path"))
        access_log.log(level, "%s %s %s", request.method, request.path, text, extra=fields)

    async def _traced(self, request: web.Request, handler: Any) -> web.StreamResponse:
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind, Status, StatusCode

        started = time.perf_counter()
        context = propagate.extract(request.headers)
        with self.tracer.start_as_current_span(
            f"{request.method} {request.path}",
            context=context,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": request.method, "url.path": request.path},
        ) as span:
            response = await handler(request)
            span.set_attribute("http.response.status_code", response.status)
            request_id = response.headers.get("x-request-id")
            if request_id:
                span.set_attribute("kvroute.request_id", request_id)
            for header, name in _FIELDS:
                value = response.headers.get(header)
                if value is not None:
                    span.set_attribute(f"kvroute.{name}", value)
            if response.status >= 500:
                span.set_status(Status(StatusCode.ERROR))
        if is_client_path(request.path):
            level = logging.INFO if self.access_log_info else logging.DEBUG
            if access_log.isEnabledFor(level):
                self._log(level, request, response, started)
        return response
