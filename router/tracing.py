"""Optional OpenTelemetry tracing of the request path (``tracing.enabled``).

Needs the ``otel`` extra (``opentelemetry-api`` and ``-sdk``; ``exporter: otlp`` also
``opentelemetry-exporter-otlp-proto-http``). Nothing here is imported unless tracing is
on, so it costs nothing otherwise. Spans, per request:

* ``POST /v1/...`` (server): continues the caller's W3C ``traceparent``; attributes
  ``kvroute.request_id``, ``kvroute.engine``, ``kvroute.prefill_engine``,
  ``kvroute.mode``, ``kvroute.reason``, the HTTP status (:mod:`router.frontends.http.observe`);
* ``kvroute.route`` (internal): one routing decision (index lookup and policy), with the
  policy, reason, chosen engine, matched blocks and candidates;
* ``kvroute.engine`` (client): each call to an engine until its response headers; the
  engine request carries ``traceparent``, so an engine that traces (vLLM's
  ``--otlp-traces-endpoint``) continues the same trace.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from router.config import ConfigError, ProxyConfig, TracingConfig
from router.core import RoutingCore
from router.http1 import Response
from router.policy.base import Decision, Policy, RouteRequest
from router.proxy import Deadline, Upstream, UpstreamError
from router.types import EngineKey


def tracer_provider(cfg: TracingConfig) -> Any:
    """A TracerProvider for ``cfg``: sampler, ``service.name`` and exporter."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError:
        raise ConfigError(
            "tracing.enabled needs OpenTelemetry: pip install 'kvroute[otel]'"
        ) from None
    provider = TracerProvider(
        resource=Resource.create({"service.name": cfg.service_name}),
        sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
    )
    if cfg.exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif cfg.exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ConfigError(
                "tracing.exporter otlp needs opentelemetry-exporter-otlp-proto-http "
                "(pip install 'kvroute[otel]')"
            ) from None
        endpoint = cfg.endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
            )
        )
    return provider


def tracer_of(provider: Any) -> Any:
    from opentelemetry import trace

    from router import __version__

    return trace.get_tracer("kvroute", __version__, tracer_provider=provider)


class Tracing:
    """One router's tracing: its tracer, and the traced routing core and engine client."""

    def __init__(self, cfg: TracingConfig, provider: Any = None) -> None:
        """``provider``: a TracerProvider to use (tests), else one made from ``cfg``,
        which the router then owns (flushes and shuts down)."""
        self.owned = provider is None
        self.provider = provider if provider is not None else tracer_provider(cfg)
        self.tracer = tracer_of(self.provider)

    def core(self, *args: Any, **kwargs: Any) -> RoutingCore:
        """A :class:`RoutingCore` (same arguments) with a span around each decision."""
        core = TracedRoutingCore(*args, **kwargs)
        core.tracer = self.tracer
        return core

    def upstream(self, cfg: ProxyConfig) -> Upstream:
        """The engine client, its calls in client spans."""
        upstream = TracedUpstream(cfg)
        upstream.tracer = self.tracer
        return upstream

    def shutdown(self) -> None:
        """Flush the spans not exported yet, if the provider is the router's."""
        if self.owned:
            self.provider.shutdown()


class TracedRoutingCore(RoutingCore):
    """The routing core with a span around each decision."""

    tracer: Any = None

    async def route(
        self,
        request: RouteRequest,
        candidates: Sequence[EngineKey],
        policy: Policy | None = None,
    ) -> Decision:
        with self.tracer.start_as_current_span("kvroute.route") as span:
            span.set_attribute("kvroute.candidates", len(candidates))
            span.set_attribute("kvroute.prompt_tokens", request.prompt_tokens)
            decision = await super().route(request, candidates, policy)
            span.set_attribute("kvroute.policy", decision.policy)
            span.set_attribute("kvroute.reason", decision.reason)
            span.set_attribute("kvroute.engine", decision.engine.label)
            span.set_attribute("kvroute.matched_blocks", decision.matched_blocks)
            return decision


class TracedUpstream(Upstream):
    """Engine calls in client spans, with ``traceparent`` on the engine request."""

    tracer: Any = None

    async def open(
        self, url: str, body: bytes, headers: Mapping[str, str]
    ) -> tuple[Response, Deadline]:
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind, Status, StatusCode

        with self.tracer.start_as_current_span(
            "kvroute.engine", kind=SpanKind.CLIENT, attributes={"url.full": url}
        ) as span:
            carrier = dict(headers)
            propagate.inject(carrier)
            try:
                response, deadline = await super().open(url, body, carrier)
            except UpstreamError as exc:
                span.set_status(Status(StatusCode.ERROR, str(exc)))
                if exc.status:
                    span.set_attribute("http.response.status_code", exc.status)
                raise
            span.set_attribute("http.response.status_code", response.status)
            return response, deadline
