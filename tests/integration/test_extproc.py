"""The Envoy ext_proc endpoint picker, driven by a real grpc.aio client with the message
sequence Envoy sends in FULL_DUPLEX_STREAMED mode (request headers, body chunks with
end of stream, response headers, response body), against emulated engines."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import json_format, struct_pb2
from grpc import aio
from support.clients import metric_sum, metrics, post
from support.engines import poll, start_test_engine
from support.grpc_clients import connect, health_status
from support.routers import start_router

from router.app import RouterApp
from router.emulator import EmulatedEngine

Mode = processing_mode_pb2.ProcessingMode


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def endpoint(engine: EmulatedEngine) -> str:
    return f"127.0.0.1:{engine.port}"


# --------------------------------------------------------------------------- Envoy's messages


def _metadata(namespaces: dict[str, dict[str, Any]]) -> base_pb2.Metadata:
    meta = base_pb2.Metadata()
    for namespace, fields in namespaces.items():
        struct = struct_pb2.Struct()
        struct.update(fields)
        meta.filter_metadata[namespace].CopyFrom(struct)
    return meta


def request_headers(
    path: str = "/v1/completions",
    *,
    eos: bool = False,
    request_id: str | None = "ext-1",
    subset: Any = None,
    body_mode: int | None = None,
    extra: dict[str, str] | None = None,
) -> ep.ProcessingRequest:
    pairs = {":method": "POST" if not eos else "GET", ":path": path, ":authority": "gw"}
    pairs["content-type"] = "application/json"
    if request_id:
        pairs["x-request-id"] = request_id
    pairs.update(extra or {})
    headers = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )
    message = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=headers, end_of_stream=eos)
    )
    if subset is not None:
        message.metadata_context.CopyFrom(
            _metadata({"envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": subset}})
        )
    if body_mode is not None:
        message.protocol_config.CopyFrom(
            ep.ProtocolConfiguration(request_body_mode=body_mode, response_body_mode=body_mode)
        )
    return message


def request_body(data: bytes, eos: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=eos))


def response_headers(served: str | None = None, eos: bool = False) -> ep.ProcessingRequest:
    headers = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":status", raw_value=b"200"),
            base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream"),
        ]
    )
    message = ep.ProcessingRequest(
        response_headers=ep.HttpHeaders(headers=headers, end_of_stream=eos)
    )
    if served is not None:
        message.metadata_context.CopyFrom(
            _metadata({"envoy.lb": {"x-gateway-destination-endpoint-served": served}})
        )
    return message


def response_body(data: bytes, eos: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(response_body=ep.HttpBody(body=data, end_of_stream=eos))


def split_body(body: dict[str, Any], pieces: int = 2) -> list[bytes]:
    raw = json.dumps(body).encode()
    step = -(-len(raw) // pieces)
    return [raw[i : i + step] for i in range(0, len(raw), step)]


# --------------------------------------------------------------------------- reading answers


def set_headers(mutation: ep.HeaderMutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def destination_of(response: ep.ProcessingResponse) -> str:
    common = response.request_headers.response
    assert common.clear_route_cache
    header = set_headers(common.header_mutation)["x-gateway-destination-endpoint"]
    metadata = json_format.MessageToDict(response.dynamic_metadata)
    assert metadata == {"envoy.lb": {"x-gateway-destination-endpoint": header}}
    return header


def echoed(responses: list[ep.ProcessingResponse]) -> tuple[bytes, bool]:
    """The request body chunks sent back, and whether the last ended the stream."""
    data, eos = b"", False
    for r in responses:
        assert r.WhichOneof("response") == "request_body"
        streamed = r.request_body.response.body_mutation.streamed_response
        data += streamed.body
        eos = streamed.end_of_stream
    return data, eos


async def route(
    stub: ep_grpc.ExternalProcessorStub,
    body: dict[str, Any] | None,
    **headers: Any,
) -> tuple[aio.StreamStreamCall, list[ep.ProcessingResponse]]:
    """Send a request's headers and body; return the open call and the answers to them."""
    call = stub.Process()
    await call.write(request_headers(**headers))
    if body is None:
        return call, [await call.read()]
    chunks = split_body(body)
    for i, chunk in enumerate(chunks):
        await call.write(request_body(chunk, eos=i == len(chunks) - 1))
    first = await call.read()
    if first.WhichOneof("response") == "immediate_response":
        return call, [first]
    out = [first]
    while True:
        message = await call.read()
        out.append(message)
        if message.request_body.response.body_mutation.streamed_response.end_of_stream:
            return call, out


async def finish(call: aio.StreamStreamCall) -> None:
    """Half-close like Envoy at the end of a request; the server ends the stream."""
    await call.done_writing()
    while await call.read() is not aio.EOF:
        pass


# --------------------------------------------------------------------------- fixtures


@pytest_asyncio.fixture(scope="module")
async def fleet(ipc_dir: Path) -> AsyncIterator[list[EmulatedEngine]]:
    engines = [
        await start_test_engine(
            engine_id=f"xp{i}",
            kv_events_endpoint=f"ipc://{ipc_dir}/xp{i}",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
        )
        for i in range(3)
    ]
    yield engines
    for engine in engines:
        await engine.stop()


@pytest_asyncio.fixture
async def picker(fleet: list[EmulatedEngine]) -> AsyncIterator[RouterApp]:
    app = await start_router([e.url for e in fleet], extproc={"port": 0})
    yield app
    await app.stop()


@pytest_asyncio.fixture
async def stub(picker: RouterApp) -> AsyncIterator[ep_grpc.ExternalProcessorStub]:
    async with aio.insecure_channel(f"127.0.0.1:{picker.extproc_port}") as channel:
        yield ep_grpc.ExternalProcessorStub(channel)


# --------------------------------------------------------------------------- tests


async def test_full_duplex_exchange_routes_echoes_and_releases(
    picker: RouterApp,
    stub: ep_grpc.ExternalProcessorStub,
    fleet: list[EmulatedEngine],
    http: aiohttp.ClientSession,
) -> None:
    for engine in fleet:
        await post(http, f"{engine.url}/reset_prefix_cache", {})
    # One engine holds the prompt's prefix: only a picker that read the body finds it.
    warm = fleet[1]
    status, _ = await post(
        http, f"{warm.url}/v1/completions", {"prompt": words("duplex", 640), "max_tokens": 1}
    )
    assert status == 200
    await poll(lambda: picker.ingestor.counters.blocks_stored >= 640 // 16)
    body = {"prompt": words("duplex", 640) + " tail", "max_tokens": 8, "stream": True}
    call, answers = await route(stub, body)
    head, *chunks = answers
    assert head.WhichOneof("response") == "request_headers"
    assert destination_of(head) == endpoint(warm)
    mutation = head.request_headers.response.header_mutation
    sent = set_headers(mutation)
    assert sent["content-length"] == str(len(json.dumps(body)))
    assert "x-prefiller-host-port" in mutation.remove_headers
    assert "x-request-id" not in sent  # Envoy's own id is kept
    data, eos = echoed(chunks)
    assert data == json.dumps(body).encode() and eos and len(chunks) == 2
    # The request now holds its engine's load, until the response ends.
    load = picker.loads.view[picker.registry.get(endpoint(warm)).keys[0]]
    assert picker.loads.in_flight == 1 and load.requests == 1 and load.prefill_tokens > 0
    await call.write(response_headers(served=endpoint(warm)))
    answer = await call.read()
    returned = set_headers(answer.response_headers.response.header_mutation)
    assert returned["x-kvroute-engine"] == endpoint(warm)
    assert returned["x-kvroute-reason"].startswith("latency:prefix_hit")
    assert returned["x-request-id"] == "ext-1"
    for i, piece in enumerate((b"data: {}\n\n", b"data: [DONE]\n\n")):
        last = i == 1
        await call.write(response_body(piece, eos=last))
        streamed = (await call.read()).response_body.response.body_mutation.streamed_response
        assert streamed.body == piece and streamed.end_of_stream == last
        if not last:  # the first token arrived: the prefill is done
            assert load.prefill_tokens == 0 and load.requests == 1
    assert picker.loads.in_flight == 0 and load.requests == 0
    await finish(call)
    samples = await metrics(http, picker.url)
    assert metric_sum(samples, "kvroute_extproc_requests_total", outcome="routed") == 1
    assert metric_sum(samples, "kvroute_picks_ended_total", how="stream_end") == 1


async def test_the_served_endpoint_takes_the_load(
    picker: RouterApp, stub: ep_grpc.ExternalProcessorStub, fleet: list[EmulatedEngine]
) -> None:
    call, answers = await route(stub, {"prompt": "fall back", "max_tokens": 4})
    chosen = destination_of(answers[0])
    other = next(endpoint(e) for e in fleet if endpoint(e) != chosen)
    await call.write(response_headers(served=other))
    answer = await call.read()
    assert set_headers(answer.response_headers.response.header_mutation)["x-kvroute-engine"] == (
        other
    )
    view = picker.loads.view
    assert view[picker.registry.get(other).keys[0]].requests == 1
    assert view[picker.registry.get(chosen).keys[0]].requests == 0
    await call.write(response_body(b"{}", eos=True))
    await call.read()
    assert picker.loads.in_flight == 0
    await finish(call)


async def test_a_stream_the_gateway_resets_releases_its_load(
    picker: RouterApp, stub: ep_grpc.ExternalProcessorStub
) -> None:
    call, _ = await route(stub, {"prompt": "reset me", "max_tokens": 4})
    assert picker.loads.in_flight == 1
    call.cancel()
    await poll(lambda: picker.loads.in_flight == 0)


async def test_the_subset_hint_limits_the_choice(
    picker: RouterApp, stub: ep_grpc.ExternalProcessorStub, fleet: list[EmulatedEngine]
) -> None:
    only = endpoint(fleet[2])
    forms: list[Any] = [[only], f"10.0.0.99:80, {only}", ["10.1.1.1:1", only]]
    for i, subset in enumerate(forms):
        call, answers = await route(
            stub, {"prompt": f"subset {i}", "max_tokens": 2}, subset=subset, request_id=f"s{i}"
        )
        assert destination_of(answers[0]) == only
        await finish(call)
    # A bare address allows each of its ports.
    call, answers = await route(stub, {"prompt": "any port", "max_tokens": 2}, subset=["127.0.0.1"])
    assert destination_of(answers[0]) in {endpoint(e) for e in fleet}
    await finish(call)
    # An empty hint, or one naming no eligible engine: 503.
    for subset in ([], ["10.0.0.1:8000"]):
        call, answers = await route(stub, {"prompt": "nowhere", "max_tokens": 2}, subset=subset)
        (answer,) = answers
        refusal = answer.immediate_response
        assert refusal.status.code == 503
        assert "subset" in json.loads(refusal.body)["error"]["message"]
        await finish(call)
    assert picker.loads.in_flight == 0


async def test_refusals_are_immediate_responses_in_openai_form(
    fleet: list[EmulatedEngine],
) -> None:
    app = await start_router(
        [e.url for e in fleet], extproc={"port": 0}, limits={"max_inflight": 1}
    )
    try:
        async with aio.insecure_channel(f"127.0.0.1:{app.extproc_port}") as channel:
            stub = ep_grpc.ExternalProcessorStub(channel)
            cases: list[tuple[Any, str, int, str]] = [
                (b"{bad json", "/v1/completions", 400, "JSON"),
                ({"prompt": "x", "model": "nope"}, "/v1/completions", 404, "nope"),
                ({"prompt": "x"}, "/v1/chat/completions", 400, "messages"),
            ]
            for body, path, status, needle in cases:
                call = stub.Process()
                await call.write(request_headers(path))
                raw = body if isinstance(body, bytes) else json.dumps(body).encode()
                await call.write(request_body(raw, eos=True))
                refusal = (await call.read()).immediate_response
                assert refusal.status.code == status
                error = json.loads(refusal.body)["error"]
                assert needle in error["message"] and error["code"] in (status, "model_not_found")
                assert set_headers(refusal.headers)["content-type"] == "application/json"
                await finish(call)
            # One routed request fills this router (limits.max_inflight = 1): shed, 429.
            held, _ = await route(stub, {"prompt": "first", "max_tokens": 2})
            call, (answer,) = await route(stub, {"prompt": "second", "max_tokens": 2})
            refusal = answer.immediate_response
            assert refusal.status.code == 429
            assert set_headers(refusal.headers)["retry-after"] == "1"
            await finish(call)
            await held.write(response_body(b"", eos=True))
            await held.read()
            await finish(held)
            # No engine ready: 503.
            for engine in app.registry:
                app.registry.drain(engine)
            call, (answer,) = await route(stub, {"prompt": "third", "max_tokens": 2})
            assert answer.immediate_response.status.code == 503
            await finish(call)
        assert app.loads.in_flight == 0
    finally:
        await app.stop()


async def test_fallbacks_are_listed_cheapest_first(fleet: list[EmulatedEngine]) -> None:
    app = await start_router([e.url for e in fleet], extproc={"port": 0, "fallbacks": 2})
    try:
        async with aio.insecure_channel(f"127.0.0.1:{app.extproc_port}") as channel:
            stub = ep_grpc.ExternalProcessorStub(channel)
            call, answers = await route(stub, {"prompt": "with fallbacks", "max_tokens": 2})
            listed = destination_of(answers[0]).split(",")
            assert len(listed) == 3 and set(listed) == {endpoint(e) for e in fleet}
            assert app.loads.view[app.registry.get(listed[0]).keys[0]].requests == 1
            await finish(call)
    finally:
        await app.stop()


async def test_a_request_without_a_body_is_routed_on_its_headers(
    stub: ep_grpc.ExternalProcessorStub, fleet: list[EmulatedEngine], picker: RouterApp
) -> None:
    call, (answer,) = await route(stub, None, path="/v1/models", eos=True)
    assert destination_of(answer) in {endpoint(e) for e in fleet}
    assert picker.loads.in_flight == 0
    await finish(call)


async def test_buffered_body_mode_routes_in_the_body_answer(
    stub: ep_grpc.ExternalProcessorStub, fleet: list[EmulatedEngine]
) -> None:
    call = stub.Process()
    await call.write(request_headers(body_mode=Mode.BUFFERED))
    first = await call.read()  # headers are answered at once, unchanged
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.HasField("header_mutation")
    await call.write(request_body(json.dumps({"prompt": "buffered"}).encode(), eos=True))
    answer = await call.read()
    common = answer.request_body.response
    assert common.clear_route_cache
    chosen = set_headers(common.header_mutation)["x-gateway-destination-endpoint"]
    assert chosen in {endpoint(e) for e in fleet}
    assert not common.HasField("body_mutation")
    await finish(call)


async def test_a_client_cannot_steer_the_prefill_sidecar(
    stub: ep_grpc.ExternalProcessorStub,
) -> None:
    call, answers = await route(
        stub,
        {"prompt": "sneaky", "max_tokens": 2},
        extra={"x-prefiller-host-port": "10.9.9.9:8000"},
    )
    mutation = answers[0].request_headers.response.header_mutation
    assert "x-prefiller-host-port" in mutation.remove_headers
    assert "x-prefiller-host-port" not in set_headers(mutation)
    await finish(call)


async def test_disaggregated_pools_name_the_prefill_engine(ipc_dir: Path) -> None:
    prefill = [await start_test_engine(engine_id=f"xpp{i}", role="prefill") for i in range(2)]
    decode = [await start_test_engine(engine_id=f"xpd{i}", role="decode") for i in range(2)]
    app = await start_router(
        [{"url": e.url, "role": "prefill"} for e in prefill]
        + [{"url": e.url, "role": "decode"} for e in decode],
        extproc={"port": 0},
    )
    try:
        async with aio.insecure_channel(f"127.0.0.1:{app.extproc_port}") as channel:
            stub = ep_grpc.ExternalProcessorStub(channel)
            call, answers = await route(stub, {"prompt": words("pd", 2000), "max_tokens": 2})
            sent = set_headers(answers[0].request_headers.response.header_mutation)
            assert destination_of(answers[0]) in {endpoint(e) for e in decode}
            assert sent["x-prefiller-host-port"] in {endpoint(e) for e in prefill}
            # Both legs hold load until the response ends.
            assert app.loads.in_flight == 2
            await call.write(response_headers())
            headers = set_headers((await call.read()).response_headers.response.header_mutation)
            assert headers["x-kvroute-mode"] == "split"
            assert headers["x-kvroute-prefill"] == sent["x-prefiller-host-port"]
            await call.write(response_body(b"{}", eos=True))
            await call.read()
            assert app.loads.in_flight == 0
            await finish(call)
            call, answers = await route(stub, {"prompt": "short", "max_tokens": 2})
            mutation = answers[0].request_headers.response.header_mutation
            assert "x-prefiller-host-port" not in set_headers(mutation)
            await finish(call)
    finally:
        await app.stop()
        for engine in prefill + decode:
            await engine.stop()


async def test_health_services_follow_draining(picker: RouterApp) -> None:
    async with connect(picker.extproc_port) as stubs:
        followers = ("readiness", "envoy.service.ext_proc.v3.ExternalProcessor", "")
        for service in (*followers, "liveness"):
            assert await health_status(stubs.health, service) == "SERVING"
        picker.begin_drain()
        for service in followers:

            async def not_serving(service: str = service) -> bool:
                return await health_status(stubs.health, service) == "NOT_SERVING"

            await poll(not_serving)
        assert await health_status(stubs.health, "liveness") == "SERVING"
        stub = ep_grpc.ExternalProcessorStub(stubs.channel)
        call, (answer,) = await route(stub, {"prompt": "late", "max_tokens": 2})
        assert answer.immediate_response.status.code == 503
        await finish(call)


HANDOFF_FIELDS = {
    "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.2"},
    "bootstrap_host": "127.0.0.2",
    "bootstrap_port": 9,
    "bootstrap_room": 12345,
}


async def test_client_handoff_fields_are_removed_from_the_body_the_gateway_forwards(
    stub: ep_grpc.ExternalProcessorStub,
) -> None:
    body = {"prompt": "handoff", "max_tokens": 2, **HANDOFF_FIELDS}
    call, (head, *chunks) = await route(stub, body)
    data, eos = echoed(chunks)
    assert eos and json.loads(data) == {"prompt": "handoff", "max_tokens": 2}
    sent = set_headers(head.request_headers.response.header_mutation)
    assert sent["content-length"] == str(len(data))
    await finish(call)
    # Buffered: the body answer carries the new body.
    call = stub.Process()
    await call.write(request_headers(body_mode=Mode.BUFFERED))
    await call.read()
    await call.write(request_body(json.dumps(body).encode(), eos=True))
    common = (await call.read()).request_body.response
    assert json.loads(common.body_mutation.body) == {"prompt": "handoff", "max_tokens": 2}
    assert set_headers(common.header_mutation)["content-length"] == str(
        len(common.body_mutation.body)
    )
    await finish(call)


async def test_streamed_mode_refuses_handoff_fields_it_can_no_longer_remove(
    stub: ep_grpc.ExternalProcessorStub,
) -> None:
    call = stub.Process()
    await call.write(request_headers(body_mode=Mode.STREAMED))
    await call.read()
    first, second = split_body({"prompt": "handoff", "max_tokens": 2, **HANDOFF_FIELDS})
    await call.write(request_body(first, eos=False))
    await call.read()  # the first chunk went on unchanged
    await call.write(request_body(second, eos=True))
    answer = (await call.read()).immediate_response
    assert answer.status.code == 400 and b"kv_transfer_params" in answer.body
    await finish(call)


@pytest.mark.parametrize(
    ("path", "body", "left"),
    [
        (
            "/inference/v1/generate",
            {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2, "extra_args": {"a": 1}}},
            ("sampling_params", "extra_args"),
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}]},
            ("vllm_xargs",),
        ),
        ("/v1/completions", {"prompt": "handoff"}, ("extra_body",)),
    ],
)
async def test_nested_handoff_fields_are_removed_from_the_body_the_gateway_forwards(
    stub: ep_grpc.ExternalProcessorStub, path: str, body: dict[str, Any], left: tuple[str, ...]
) -> None:
    def inside(payload: dict[str, Any]) -> dict[str, Any]:
        """``left``'s object in ``payload`` (made empty where absent)."""
        for key in left:
            payload = payload.setdefault(key, {})
        return payload

    sent, expected = json.loads(json.dumps(body)), json.loads(json.dumps(body))
    inside(expected)
    inside(sent).update(
        kv_transfer_params=HANDOFF_FIELDS["kv_transfer_params"],
        ec_transfer_params={"peer_host": "127.0.0.2"},
    )
    call, (head, *chunks) = await route(stub, sent, path=path)
    data, eos = echoed(chunks)
    assert eos and json.loads(data) == expected
    assert set_headers(head.request_headers.response.header_mutation)["content-length"] == str(
        len(data)
    )
    await finish(call)


async def test_a_json_body_the_router_cannot_read_is_refused_not_passed_on(
    stub: ep_grpc.ExternalProcessorStub,
) -> None:
    """On a path routed by load, a JSON body nested deeper than the router reads could
    still carry router-owned fields to an engine's parser: refused with 400."""
    deep: dict[str, Any] = {"kv_transfer_params": {"remote_host": "127.0.0.2"}}
    for _ in range(40):
        deep = {"x": deep}
    call, (answer,) = await route(stub, deep, path="/inference/v1/generate")
    assert answer.immediate_response.status.code == 400
    assert b"deeper than" in answer.immediate_response.body
    await finish(call)


async def test_an_authorization_header_sent_twice_is_refused_with_400(
    stub: ep_grpc.ExternalProcessorStub,
) -> None:
    """Flow control would take one key, the engine perhaps the other."""
    message = request_headers(eos=True)  # answered at the headers either way
    for key in ("Bearer a", "Bearer b"):
        message.request_headers.headers.headers.append(
            base_pb2.HeaderValue(key="authorization", raw_value=key.encode())
        )
    call = stub.Process()
    await call.write(message)
    answer = (await call.read()).immediate_response
    assert answer.status.code == 400
    assert json.loads(answer.body)["error"]["param"] == "authorization"
    await finish(call)
