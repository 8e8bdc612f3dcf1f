"""OpenTelemetry tracing of the request path, collected by an in-memory exporter."""

from __future__ import annotations

import pytest
from support.clients import post_reply
from support.engines import poll
from support.routers import router_config

from router.app import RouterApp
from router.emulator import EmulatedEngine

sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra is not installed")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


async def test_a_request_is_one_trace_continuing_the_callers(engine: EmulatedEngine, http) -> None:
    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = RouterApp(router_config([engine.url]), tracer_provider=provider)
    await app.start()
    try:
        await poll(lambda: app.registry.models())
        model = next(m for m in app.registry.models() if app.registry.base_of(m) == m)
        reply = await post_reply(
            http,
            f"{app.url}/v1/completions",
            {"model": model, "prompt": "trace me", "max_tokens": 2},
            headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "x-request-id": "traced-1"},
        )
        assert reply.status == 200
        spans = {s.name: s for s in exporter.get_finished_spans()}
        server = spans["POST /v1/completions"]
        route, call = spans["kvroute.route"], spans["kvroute.engine"]
        assert format(server.context.trace_id, "032x") == TRACE_ID
        assert format(server.parent.span_id, "016x") == PARENT_ID
        assert route.parent.span_id == server.context.span_id
        assert call.parent.span_id == server.context.span_id
        assert server.attributes["kvroute.request_id"] == "traced-1"
        assert server.attributes["kvroute.engine"] == reply.headers["x-kvroute-engine"]
        assert server.attributes["kvroute.reason"] == reply.headers["x-kvroute-reason"]
        assert server.attributes["http.response.status_code"] == 200
        assert route.attributes["kvroute.policy"] == "latency"
        assert call.attributes["url.full"] == engine.url + "/v1/completions"
    finally:
        await app.stop()


async def test_tracing_is_off_unless_configured(engine: EmulatedEngine) -> None:
    app = RouterApp(router_config([engine.url]))
    assert app.tracer is None
    assert type(app.core).__name__ == "RoutingCore"
