"""The gRPC API under hostile input: every call ends with OK or a documented status
code and a message, never UNKNOWN/INTERNAL, never a hang; the router keeps serving.

The router runs as a real process (``kvroute serve --grpc-port``) in front of an
emulated engine; calls use a blocking channel with a deadline.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from hypothesis import example, given
from hypothesis import strategies as st

from router.grpc.gen.kvroute.v1 import router_pb2 as pb
from router.grpc.gen.kvroute.v1 import router_pb2_grpc as pb_grpc
from router.process import EngineProcess, ServerProcess

ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.DEADLINE_EXCEEDED,  # an engine timeout (504), with a message
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def channel() -> Iterator[grpc.Channel]:
    engine = EngineProcess(["--port", "0", "--time-scale", "0.001", "--max-model-len", "4096"])
    port = free_port()
    try:
        router = ServerProcess(
            "serve",
            [
                "--port",
                "0",
                "--engine",
                engine.url,
                "--grpc-port",
                str(port),
                "--log-level",
                "error",
            ],
        )
    except BaseException:
        engine.stop()
        raise
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=10)
        yield channel
    finally:
        channel.close()
        router.stop()
        engine.stop()


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.RouterStub:
    return pb_grpc.RouterStub(channel)


def outcome(call: object) -> grpc.StatusCode:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as err:
        code = err.code()  # type: ignore[attr-defined]
        assert code in ALLOWED, (code, err.details())  # type: ignore[attr-defined]
        assert err.details(), code  # type: ignore[attr-defined]
        return code
    return grpc.StatusCode.OK


text = st.text(max_size=60)
prompts = st.one_of(
    st.builds(lambda t: {"text": t}, text),
    st.builds(
        lambda ids: {"token_ids": pb.TokenIds(ids=ids)},
        st.lists(st.integers(0, 2**32 - 1), max_size=80),
    ),
    st.builds(
        lambda msgs: {"messages": pb.Messages(messages=msgs)},
        st.lists(st.builds(pb.ChatMessage, role=text, content=text, name=text), max_size=4),
    ),
    st.builds(
        lambda keys, n: {"block_keys": pb.BlockKeys(keys=keys, prompt_tokens=n)},
        st.lists(st.integers(0, 2**64 - 1), max_size=40),
        st.integers(0, 2**32 - 1),
    ),
    st.builds(lambda b: {"body": b}, st.binary(max_size=200)),
    st.builds(
        lambda d: {"body": json.dumps(d).encode()},
        st.dictionaries(
            st.sampled_from(["prompt", "messages", "model", "max_tokens", "n", "cache_salt"]),
            st.none() | st.integers(-5, 10**12) | text | st.lists(st.integers(-3, 2**33)),
        ),
    ),
)


@given(
    prompt=prompts,
    request_id=st.one_of(st.just(""), text),
    model=st.one_of(st.just(""), st.just("kvroute-emulated"), text),
    max_tokens=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
    n=st.integers(0, 2**32 - 1),
    cache_salt=text,
    subset=st.lists(text, max_size=3),
    headers=st.dictionaries(st.sampled_from(["x-request-id", "x-session-id", "x"]), text),
)
def test_pick_with_hostile_fields(
    stub: pb_grpc.RouterStub,
    prompt: dict,
    request_id: str,
    model: str,
    max_tokens: int | None,
    n: int,
    cache_salt: str,
    subset: list[str],
    headers: dict[str, str],
) -> None:
    request = pb.PickRequest(
        request_id=request_id,
        model=model,
        n=n,
        cache_salt=cache_salt,
        subset=subset,
        headers=headers,
        **prompt,
    )
    if max_tokens is not None:
        request.max_tokens = max_tokens
    picked: list[pb.PickResponse] = []
    code = outcome(lambda: picked.append(stub.Pick(request, timeout=10)))
    if code is grpc.StatusCode.OK:
        stub.Release(pb.ReleaseRequest(request_id=picked[0].request_id), timeout=10)


@given(
    endpoint=st.sampled_from(list(pb.Endpoint.values())),
    body=st.one_of(
        st.binary(max_size=200),
        st.builds(
            lambda d: json.dumps(d).encode(),
            st.fixed_dictionaries(
                {"max_tokens": st.integers(0, 4)},
                optional={
                    "prompt": text | st.lists(st.integers(-3, 2**33), max_size=20),
                    "messages": st.lists(
                        st.fixed_dictionaries({"role": text, "content": text}), max_size=3
                    ),
                    "stream": st.booleans() | text,
                    "n": st.integers(-1, 3),
                },
            ),
        ),
    ),
    request_id=st.one_of(st.just(""), text),
)
def test_generate_with_hostile_fields(
    stub: pb_grpc.RouterStub, endpoint: int, body: bytes, request_id: str
) -> None:
    request = pb.GenerateRequest(endpoint=endpoint, body=body, request_id=request_id)
    outcome(lambda: list(stub.Generate(request, timeout=10)))


#: Methods of the API listener, with their request type and whether they stream answers.
RAW_METHODS = {
    "/kvroute.v1.Router/Pick": (pb.PickRequest, False),
    "/kvroute.v1.Router/Release": (pb.ReleaseRequest, False),
    "/kvroute.v1.Router/Generate": (pb.GenerateRequest, True),
    "/kvroute.v1.Admin/ListEngines": (pb.ListEnginesRequest, False),
    "/kvroute.v1.Admin/DrainEngine": (pb.EngineRef, False),
    "/grpc.health.v1.Health/Check": (health_pb2.HealthCheckRequest, False),
}


@given(method=st.sampled_from(sorted(RAW_METHODS)), data=st.binary(max_size=64))
@example(method="/kvroute.v1.Router/Pick", data=b"\xff\xff\xff")  # UNKNOWN (issue 44, item 9)
@example(method="/kvroute.v1.Router/Generate", data=b"\x0a\x05ab")
@example(method="/grpc.health.v1.Health/Check", data=b"\x80")
def test_bytes_that_are_no_message_are_invalid_argument(
    channel: grpc.Channel, method: str, data: bytes
) -> None:
    """Any bytes as a request: a message that does not decode is INVALID_ARGUMENT (it
    was UNKNOWN, quoting the decoder's exception class); one that does is served."""
    message_type, streams = RAW_METHODS[method]
    try:
        message_type.FromString(data)
        decodes = True
    except DecodeError:
        decodes = False
    if streams:
        code = outcome(lambda: list(channel.unary_stream(method)(data, timeout=10)))
    else:
        code = outcome(lambda: channel.unary_unary(method)(data, timeout=10))
    if not decodes:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, code


def test_the_router_still_serves(stub: pb_grpc.RouterStub) -> None:
    pick = stub.Pick(pb.PickRequest(text="still here"), timeout=10)
    assert pick.decode.endpoint
    stub.Release(pb.ReleaseRequest(request_id=pick.request_id), timeout=10)
