"""Speaking Envoy's ext_proc protocol to a router in tests: the messages of a request."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2


def header_map(pairs: Mapping[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )


def request_messages(
    headers: Mapping[str, str], body: bytes, flow: dict[str, Any] | None = None
) -> list[ep.ProcessingRequest]:
    """A POST to /v1/completions with ``headers`` and the whole ``body``, as Envoy sends
    it: the headers (with the gateway's ``kvroute.flow`` metadata, if any), then the
    body in one chunk."""
    pairs = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}
    first = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=header_map({**pairs, **headers}))
    )
    if flow is not None:
        meta = struct_pb2.Struct()
        meta.update(flow)
        first.metadata_context.filter_metadata["kvroute.flow"].CopyFrom(meta)
    return [first, ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))]
