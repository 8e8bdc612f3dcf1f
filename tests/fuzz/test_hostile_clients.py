"""Hostile clients across every front end: no 5xx of the router's own (issue 19).

``kvroute serve`` (HTTP, its admin API, gRPC) and ``kvroute sidecar`` run as real
processes in front of an emulated engine; memory is read from /proc. Hypothesis sends
header values of arbitrary bytes, compressed bodies (valid, mangled, bombs), JSON nested
too deep at any position of a request, and client-supplied fields that belong to the
router; fixed batches of slow clients (idle, a head or a body sent too slowly) must be
closed within the configured timeouts while others are served. "Of its own" means a
500, or a 5xx with code ``router_error`` (gRPC ``UNAVAILABLE``, ``INTERNAL`` or
``UNKNOWN``): the engine is healthy throughout. Bounded by the hypothesis profile
(``ci`` in ``make test``, ``fuzz`` in ``make fuzz``).
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import httpx
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from support.engines import poll_sync

from router.grpc.gen.kvroute.v1 import router_pb2 as pb
from router.grpc.gen.kvroute.v1 import router_pb2_grpc as pb_grpc
from router.handoff.fields import OWNED_PATHS
from router.process import EngineProcess, ServerProcess
from router.serving.headers import SINGLE_HEADERS

MODEL = "kvroute-emulated"
HEADER_TIMEOUT_S, BODY_TIMEOUT_S, KEEPALIVE_S = 1.0, 1.5, 2.0
CONFIG = f"""
server:
  header_timeout_s: {HEADER_TIMEOUT_S}
  body_timeout_s: {BODY_TIMEOUT_S}
  keepalive_timeout_s: {KEEPALIVE_S}
limits:
  max_output_tokens: 64
  max_prompt_tokens: 2048
  max_n: 4
  max_prompts: 16
grpc:
  port: 0
"""
ROUTERS_OWN_GRPC = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


class Fleet:
    """An engine, a router (HTTP and gRPC) and a sidecar, each its own process."""

    def __init__(self, tmp: Path) -> None:
        self.engine = EngineProcess(
            [
                *("--port", "0", "--cache-blocks", "4096"),
                *("--max-model-len", "4096", "--time-scale", "0.001"),
            ]
        )
        self.procs: list[ServerProcess] = [self.engine]
        try:
            config = tmp / "router.yaml"
            config.write_text(CONFIG)
            self.router = ServerProcess(
                "serve",
                [
                    *("--port", "0", "--engine", self.engine.url),
                    *("--config", str(config), "--log-level", "error"),
                ],
            )
            self.procs.append(self.router)
            grpc_line = self.router.read_line(timeout=30)
            self.grpc_port = int(grpc_line.rsplit(":", 1)[1])
            self.sidecar = ServerProcess(
                "sidecar",
                [
                    *("--port", "0", "--engine", self.engine.url),
                    *("--allow", "127.0.0.0/8", "--log-level", "error"),
                ],
            )
            self.procs.append(self.sidecar)
        except BaseException:
            self.stop()
            raise
        self.client = httpx.Client(timeout=30.0)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        self.grpc = pb_grpc.RouterStub(self.channel)

    def memory_kib(self, field: str) -> int:
        status = Path(f"/proc/{self.router.proc.pid}/status").read_text()
        return int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith(field)))

    def alive(self) -> None:
        assert self.client.get(f"{self.router.url}/health").status_code == 200
        assert self.client.get(f"{self.sidecar.url}/health").status_code == 200

    def stop(self) -> None:
        if hasattr(self, "client"):
            self.client.close()
            self.channel.close()
        for proc in reversed(self.procs):
            proc.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path_factory.mktemp("hostile-clients"))
    poll_sync(lambda: fleet.client.get(f"{fleet.router.url}/ready").status_code == 200)
    yield fleet
    fleet.stop()


def raw(url: str, data: bytes, timeout: float = 30.0) -> tuple[int, bytes]:
    """Send bytes no client library would; (status, body) of the answer (0: closed)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    if not answer:
        return 0, b""
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def request(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
        + extra
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )


def not_the_routers_fault(status: int, body: bytes) -> None:
    """No 500, no 5xx ``router_error``; an error from the router is OpenAI's JSON."""
    assert status != 500, body[:300]
    if status >= 500:
        assert status in (502, 503, 504), (status, body[:300])
        assert b"router_error" not in body, body[:300]
    if status >= 400 and body.startswith(b"{"):
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str) and error["message"]


def generate_code(fleet: Fleet, req: pb.GenerateRequest) -> grpc.StatusCode:
    try:
        for _ in fleet.grpc.Generate(req, timeout=30):
            pass
    except grpc.RpcError as err:
        return err.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


BODY = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1}).encode()

# ---------------------------------------------------------------------------- headers

HEADER_NAMES = [
    "Expect",
    "Authorization",
    "x-api-key",
    "X-Session-Id",
    "X-Request-Id",
    "X-data-parallel-rank",
    "X-Prefiller-Host-Port",
    "Content-Encoding",
    "Content-Type",
    "traceparent",
    "User-Agent",
    "X-Anything",
]
#: Any byte but CR and LF, which would end the header line (framing is aiohttp's job).
header_bytes = st.binary(max_size=80).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


@given(
    name=st.sampled_from(HEADER_NAMES),
    value=header_bytes,
    target=st.sampled_from(["router", "chat", "admin", "sidecar"]),
    twice=st.booleans(),
)
@example(name="Expect", value=b"\xff\xfe", target="router", twice=False)  # a 500 (issue 44, 8)
@example(name="Expect", value=b"caf\xe9", target="sidecar", twice=False)
def test_header_values_of_any_bytes(
    fleet: Fleet, name: str, value: bytes, target: str, twice: bool
) -> None:
    """...and a header sent twice: a credential (``SINGLE_HEADERS``) twice is a 400."""
    url, path = {
        "router": (fleet.router.url, "/v1/completions"),
        "chat": (fleet.router.url, "/v1/chat/completions"),
        "admin": (fleet.router.url, "/admin/engines/127.0.0.1:1/undrain"),
        "sidecar": (fleet.sidecar.url, "/v1/completions"),
    }[target]
    body = BODY
    if target == "chat":
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        body = body.encode()
    line = name.encode() + b": " + value + b"\r\n"
    status, answer = raw(url, request(path, body, line * (2 if twice else 1)))
    assert status != 0
    not_the_routers_fault(status, answer)
    if twice and name.lower() in SINGLE_HEADERS:
        assert status == 400, answer


@given(headers=st.dictionaries(st.sampled_from([n.lower() for n in HEADER_NAMES]), st.text()))
def test_generate_headers_of_any_text(fleet: Fleet, headers: dict[str, str]) -> None:
    code = generate_code(fleet, pb.GenerateRequest(body=BODY, headers=headers))
    assert code not in ROUTERS_OWN_GRPC, code


# ---------------------------------------------------------------------------- framing

#: Bytes no token (a method, a header name) may hold; space, CR, LF and ":" are framing.
NOT_TOKEN = b'\x00\x01\x7f\x80\xff()<>@,;\\"/[]?={}'


@st.composite
def malformed_requests(draw: st.DrawFn) -> bytes:
    """A request aiohttp's parser refuses (or, for ``Expect``, cannot answer): issue 44
    items 8 and 10, each was an ERROR with a traceback and the Expect one a 500."""
    word = draw(st.binary(min_size=1, max_size=8).map(lambda b: bytes(65 + c % 26 for c in b)))
    bad = bytes([draw(st.sampled_from(NOT_TOKEN))])
    at = draw(st.integers(min_value=0, max_value=len(word)))
    spoilt = word[:at] + bad + word[at:]
    kind = draw(
        st.sampled_from(["method", "header name", "length", "both lengths", "chunk", "expect"])
    )
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    if kind == "method":
        return spoilt + b" /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n"
    if kind == "header name":
        return head + b"X-" + spoilt + b": v\r\nContent-Length: 0\r\n\r\n"
    if kind == "length":
        return head + b"Content-Length: " + spoilt + b"\r\n\r\n"
    if kind == "both lengths":
        return head + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    if kind == "chunk":
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + word + b"Z\r\n{}\r\n0\r\n\r\n"
    invalid = draw(st.sampled_from([b"\xff", b"\xc3", b"\xe9", b"\x80\x80"]))
    return request("/v1/completions", BODY, b"Expect: " + word + invalid + b"\r\n")


def errors_logged(proc: ServerProcess) -> int:
    """ERROR lines the process has written to its stderr so far (read without moving
    the offset the process writes at)."""
    return os.pread(proc.stderr.fileno(), 1 << 24, 0).count(b" ERROR ")


@given(data=malformed_requests(), target=st.sampled_from(["router", "sidecar"]))
def test_malformed_requests_are_a_400_and_no_error_log(
    fleet: Fleet, data: bytes, target: str
) -> None:
    proc = fleet.router if target == "router" else fleet.sidecar
    logged = errors_logged(proc)
    status, answer = raw(proc.url, data)
    assert status == 400, (status, answer[:300])
    assert json.loads(answer)["error"]["message"]
    assert errors_logged(proc) == logged


# ---------------------------------------------------------------------------- compressed

CODINGS = ["gzip", "x-gzip", "deflate", "identity", "gzip, deflate", "br", "zstd", "bogus", ""]


def encode(body: bytes, coding: str) -> bytes:
    for one in [c.strip() for c in coding.split(",") if c.strip()]:
        if one in ("gzip", "x-gzip"):
            body = gzip.compress(body)
        elif one == "deflate":
            body = zlib.compress(body)
    return body


@given(
    payload=st.sampled_from(
        [BODY, b'{"prompt": [1, 2, 3], "max_tokens": 1}', b"{}", b"[", b"not json", b""]
    ),
    coding=st.sampled_from(CODINGS),
    mangle=st.sampled_from(["none", "truncate", "flip", "prefix", "suffix"]),
    offset=st.integers(min_value=0, max_value=1_000),
    target=st.sampled_from(["router", "sidecar"]),
)
def test_compressed_bodies(
    fleet: Fleet, payload: bytes, coding: str, mangle: str, offset: int, target: str
) -> None:
    data = encode(payload, coding)
    if data and mangle == "truncate":
        data = data[: offset % len(data)]
    elif data and mangle == "flip":
        at = offset % len(data)
        data = data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1 :]
    elif mangle == "prefix":
        data = b"\x00garbage" + data
    elif mangle == "suffix":
        data = data + b"trailing"
    url = fleet.router.url if target == "router" else fleet.sidecar.url
    extra = f"Content-Encoding: {coding}\r\n".encode() if coding else b""
    status, answer = raw(url, request("/v1/completions", data, extra))
    not_the_routers_fault(status, answer)
    if mangle == "none" and payload == BODY and coding not in ("br", "zstd", "bogus"):
        assert status == 200, answer[:300]


def test_gzip_bombs_cost_at_most_the_body_limit(fleet: Fleet) -> None:
    """Six 200 MB gzip bombs at once (about 200 KB each): each is a 413 after at most
    ``limits.max_body_bytes`` (16 MiB) of inflated bytes; the router's peak memory
    grows by well under what one bomb would inflate to (it grew by 302 MB)."""
    bomb = gzip.compress(b"\0" * (200 << 20), 9)
    peak = fleet.memory_kib("VmHWM")
    answers: list[tuple[int, bytes]] = []

    def send() -> None:
        answers.append(
            raw(fleet.router.url, request("/v1/completions", bomb, b"Content-Encoding: gzip\r\n"))
        )

    threads = [threading.Thread(target=send) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)  # each exchange's socket times out after 30 s of silence
        assert not thread.is_alive(), "a bomb's exchange is still running after 60 s"
    assert [status for status, _ in answers] == [413] * 6
    grown_mib = (fleet.memory_kib("VmHWM") - peak) / 1024
    assert grown_mib < 48, grown_mib
    fleet.alive()


# ---------------------------------------------------------------------------- nesting

DEEP = "__deep__"
trees = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)


def containers(node: Any) -> list[Any]:
    found = []
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, dict)):
            found.append(item)
            stack.extend(item.values() if isinstance(item, dict) else item)
    return found


@st.composite
def deeply_nested(draw: st.DrawFn) -> tuple[bytes, dict[str, Any]]:
    """A completion or chat body with nesting deeper than the limit at a drawn position:
    any member of any container, lists that start and end with scalars included."""
    chat = draw(st.booleans())
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 1}
    if chat:
        base["messages"] = [{"role": "user", "content": ["hi", {"type": "text", "text": "x"}]}]
    else:
        base["prompt"] = draw(st.sampled_from(["a", ["a", "b"], [1, 2, 3], [[1, 2], [3]]]))
    base["extra"] = draw(trees)
    hosts = containers(base)
    host = hosts[draw(st.integers(min_value=0, max_value=len(hosts) - 1))]
    if isinstance(host, list):
        host.insert(draw(st.integers(min_value=0, max_value=len(host))), DEEP)
    else:
        host[draw(st.text(max_size=4)) + "_deep"] = DEEP
    depth = draw(st.integers(min_value=40, max_value=3_000))
    nest = "[" * depth + draw(st.sampled_from(["", "1", '"x"', "{}"])) + "]" * depth
    text = json.dumps(base).replace(json.dumps(DEEP), nest, 1)
    return text.encode(), base


@given(case=deeply_nested(), target=st.sampled_from(["router", "admin", "sidecar", "grpc"]))
def test_nesting_too_deep_at_any_position_is_a_400(
    fleet: Fleet, case: tuple[bytes, dict[str, Any]], target: str
) -> None:
    body, _ = case
    if target == "grpc":
        code = generate_code(fleet, pb.GenerateRequest(body=body))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, code
        return
    url, path, extra = {
        "router": (fleet.router.url, "/v1/completions", b""),
        "admin": (fleet.router.url, "/admin/engines", b""),
        "sidecar": (
            fleet.sidecar.url,
            "/v1/completions",
            b"X-Prefiller-Host-Port: 127.0.0.1:1\r\n",
        ),
    }[target]
    status, answer = raw(url, request(path, body, extra))
    assert status == 400, (status, answer[:300])
    assert b"deeper" in answer


# ---------------------------------------------------------------------------- slow clients


class Slow:
    """One slow client: connects, sends ``first``, then ``drip`` a byte per ``interval``."""

    def __init__(self, url: str, first: bytes, drip: bytes = b"", interval: float = 0.25):
        parts = urlsplit(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
        self.first, self.drip, self.interval = first, drip, interval
        self.answer = b""
        self.closed_after: float | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            self.sock.sendall(self.first)
            self.sock.setblocking(False)
            for byte in self.drip:
                time.sleep(self.interval)
                if self._closed():
                    break
                self.sock.send(bytes([byte]))
            self.sock.settimeout(30)
            while chunk := self.sock.recv(65536):
                self.answer += chunk
        except OSError:
            pass
        self.closed_after = time.monotonic() - started
        self.sock.close()

    def _closed(self) -> bool:
        try:
            chunk = self.sock.recv(65536)
        except BlockingIOError:
            return False
        except OSError:
            return True
        self.answer += chunk
        return not chunk


@pytest.mark.timeout(120)
def test_slow_clients_are_closed_within_the_timeouts_while_others_are_served(
    fleet: Fleet,
) -> None:
    head = request("/v1/completions", BODY).split(b"\r\n\r\n")[0] + b"\r\n\r\n"
    kinds = {
        "idle": ("", b"", KEEPALIVE_S),
        "slow head": ("", head, HEADER_TIMEOUT_S),
        "half a request line": ("POST /v1/compl", b"", HEADER_TIMEOUT_S),
        "unfinished body": (head.decode() + BODY[:5].decode(), b"", BODY_TIMEOUT_S),
        "slow body": (head.decode(), BODY, BODY_TIMEOUT_S),
    }
    clients = {
        kind: [Slow(fleet.router.url, first.encode(), drip) for _ in range(40)]
        for kind, (first, drip, _) in kinds.items()
    }
    served = 0
    deadline = time.monotonic() + 60
    while any(c.thread.is_alive() for group in clients.values() for c in group):
        assert time.monotonic() < deadline
        reply = fleet.client.post(f"{fleet.router.url}/v1/completions", content=BODY)
        assert reply.status_code == 200, reply.text
        served += 1
        time.sleep(0.05)
    assert served >= 3
    for kind, group in clients.items():
        timeout = kinds[kind][2]
        for client in group:
            assert client.closed_after is not None
            assert client.closed_after < timeout + 10, (kind, client.closed_after)
            if client.answer:
                status = int(client.answer.split()[1])
                assert status == 408, (kind, client.answer[:200])
    fleet.alive()


# ---------------------------------------------------------------------------- owned fields

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=10,
)
owned_fields = st.fixed_dictionaries(
    {},
    optional={
        "kv_transfer_params": json_values
        | st.fixed_dictionaries(
            {
                "do_remote_prefill": st.booleans(),
                "remote_engine_id": st.text(max_size=8),
                "remote_block_ids": st.lists(
                    st.integers(min_value=-1, max_value=2**40), max_size=4
                ),
                "remote_host": st.sampled_from(["127.0.0.2", "127.0.0.1", "", "::1", "x"]),
                "remote_port": st.integers(min_value=-1, max_value=70_000),
                "remote_request_id": st.text(max_size=8),
            }
        ),
        "bootstrap_host": json_values | st.sampled_from(["127.0.0.2", "127.0.0.1"]),
        "bootstrap_port": json_values | st.integers(min_value=-1, max_value=70_000),
        "bootstrap_room": json_values | st.integers(min_value=-(2**64), max_value=2**64),
    },
)


#: The objects a router-owned field may hide in (router.handoff.fields.OWNED_PATHS).
hiding_places = st.sampled_from(sorted({path[:-1] for path in OWNED_PATHS}))


@given(
    fields=owned_fields,
    inside=hiding_places,
    chat=st.booleans(),
    stream=st.booleans(),
    target=st.sampled_from(["router", "sidecar", "grpc"]),
)
def test_client_supplied_router_owned_fields(
    fleet: Fleet,
    fields: dict[str, Any],
    inside: tuple[str, ...],
    chat: bool,
    stream: bool,
    target: str,
) -> None:
    for key in reversed(inside):
        fields = {key: fields}
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "stream": stream, **fields}
    if chat:
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body["prompt"] = "hello"
    data = json.dumps(body).encode()
    if target == "grpc":
        code = generate_code(fleet, pb.GenerateRequest(body=data))
        assert code not in ROUTERS_OWN_GRPC, code
        return
    url = fleet.router.url if target == "router" else fleet.sidecar.url
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, answer = raw(url, request(path, data))
    not_the_routers_fault(status, answer)
