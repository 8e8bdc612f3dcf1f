"""Client-supplied router-owned handoff fields, of any shape, on every API that forwards
to engines: the router answers what it documents (never a 5xx of its own), and no
engine ever acts on them.

The router (``kvroute serve`` with ``--grpc-port``) and its engine run as real
processes. Every ``kv_transfer_params`` that is an object names a NIXL side channel on
127.0.0.2 (another host, as far as the engine knows), where a listener counts the
connections: an engine that received one would dial it to pull KV.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.engines import poll_sync
from support.listener import CountingListener

from router.grpc.gen.kvroute.v1 import router_pb2 as pb
from router.grpc.gen.kvroute.v1 import router_pb2_grpc as pb_grpc
from router.handoff.fields import ROUTER_OWNED
from router.process import EngineProcess, ServerProcess

DOCUMENTED = {200, 400, 404, 413, 429, 502, 503, 504}


class Fleet:
    def __init__(self) -> None:
        self.listener = CountingListener("127.0.0.2")
        self.engine = EngineProcess(["--port", "0", "--time-scale", "0.001"])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            grpc_port = s.getsockname()[1]
        try:
            self.router = ServerProcess(
                "serve",
                [
                    "--port",
                    "0",
                    "--engine",
                    self.engine.url,
                    "--grpc-port",
                    str(grpc_port),
                    "--log-level",
                    "error",
                ],
            )
        except BaseException:
            self.engine.stop()
            self.listener.close()
            raise
        self.client = httpx.Client(base_url=self.router.url, timeout=10)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        self.grpc = pb_grpc.RouterStub(self.channel)

    def stop(self) -> None:
        self.client.close()
        self.channel.close()
        self.router.stop()
        self.engine.stop()
        self.listener.close()


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    fleet = Fleet()
    poll_sync(lambda: fleet.client.get("/ready").status_code == 200)
    yield fleet
    fleet.stop()


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)
owned = st.dictionaries(st.sampled_from(ROUTER_OWNED), json_values, min_size=1)


def aimed(fields: dict[str, Any], port: int) -> dict[str, Any]:
    """The fields, with an object ``kv_transfer_params`` made a pull from the listener."""
    params = fields.get("kv_transfer_params")
    if isinstance(params, dict):
        fields["kv_transfer_params"] = {
            **params,
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "x",
            "remote_block_ids": [[1]],
            "remote_request_id": "r",
            "remote_host": "127.0.0.2",
            "remote_port": port,
        }
    return fields


@given(
    fields=owned,
    chat=st.booleans(),
    api=st.sampled_from(["http", "grpc"]),
    stream=st.booleans(),
)
def test_handoff_fields_of_any_shape_never_reach_an_engine(
    fleet: Fleet, fields: dict[str, Any], chat: bool, api: str, stream: bool
) -> None:
    base: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "hello"}]} if chat else {"prompt": "hello"}
    )
    body = {**base, "max_tokens": 2, "stream": stream, **aimed(fields, fleet.listener.port)}
    if api == "http":
        resp = fleet.client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
        assert resp.status_code in DOCUMENTED, (resp.status_code, resp.text[:300])
        assert resp.status_code == 200, resp.text[:300]  # the rest of the body is valid
    else:
        request = pb.GenerateRequest(body=json.dumps(body).encode())
        chunks = list(fleet.grpc.Generate(request, timeout=30))
        assert chunks and chunks[0].status == 200, chunks[:1]
    assert fleet.listener.accepted == 0
