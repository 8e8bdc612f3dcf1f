"""``kvroute sidecar``: in front of a decode pod's engine (llm-d's P/D sidecar protocol).

A gateway picks the decode pod and names the prefill engine in the header
``x-prefiller-host-port: ip:port``. The sidecar runs the NIXL prefill leg there, then the
decode leg on its local engine with the returned ``kv_transfer_params``, and relays the
answer. Without the header a request passes straight through. The header's target must
be on the allow-list (``--allow`` addresses ``ip:port`` or CIDRs): anything else is
refused with 403, so the sidecar cannot be used to reach arbitrary hosts. Either way a
client's own handoff fields (``kv_transfer_params``, ``ec_transfer_params``,
``bootstrap_*``, wherever :mod:`router.handoff.fields` says they hide) are removed
first, unless ``--allow-client-handoff-fields`` (so a body that is not a JSON object, or
nests too deep, is a 400 before it reaches an engine).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import re
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
from aiohttp import web

from router.config import ENV_PREFIX, ConfigError, ProxyConfig, ServerConfig, load_config
from router.frontends.http.body import read_body
from router.frontends.http.downstream import HttpDownstream
from router.frontends.http.listener import BoundSite, ConnectionGuard, ListenError, bind
from router.frontends.http.routes import error_response, openai_errors
from router.handoff import nixl
from router.handoff import sidecar as sidecar_dialect
from router.http1 import HTTPError
from router.proxy import Upstream, UpstreamError
from router.serving.errors import ApiError, bad_request
from router.serving.forward import EngineCall
from router.serving.owned import OwnedFields
from router.serving.parsing import decode_body
from router.serving.relay import RelayHooks
from router.serving.usage import UsageTap, cached_tokens

log = logging.getLogger("kvroute.sidecar")
HEADER = sidecar_dialect.HEADER
_HOST_PORT = re.compile(r"\[?([0-9A-Za-z.:-]+?)\]?:(\d{1,5})")
_PATHS = ("/v1/completions", "/v1/chat/completions")
_decode = msgspec.json.decode
_encode = msgspec.json.encode
_GONE = "client left before the end of a stream from %s"


class _LocalStream(RelayHooks):
    """The local engine's stream as it is; one that breaks ends with an error event."""

    def broke(self, exc: HTTPError) -> bytes:
        return ApiError(502, f"the engine's stream broke: {exc}").sse()


_LOCAL_STREAM = _LocalStream()


class AllowList:
    """Prefill targets the sidecar may contact: exact ``ip:port`` pairs or IP networks."""

    def __init__(self, entries: Sequence[str]) -> None:
        self.pairs: set[tuple[str, int]] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in entries:
            match = _HOST_PORT.fullmatch(entry)
            if match and not entry.count("/"):
                self.pairs.add((match.group(1), int(match.group(2))))
            else:
                self.networks.append(ipaddress.ip_network(entry, strict=False))

    def allows(self, host: str, port: int) -> bool:
        if (host, port) in self.pairs:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False  # names are not resolved: only literal, listed addresses
        return any(address in net for net in self.networks)


def parse_target(value: str) -> tuple[str, int]:
    """``ip:port`` from the header, or a 400."""
    match = _HOST_PORT.fullmatch(value.strip())
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise bad_request(f"{HEADER} must be ip:port, got {value[:60]!r}", HEADER)
    return match.group(1), int(match.group(2))


class Sidecar:
    """The sidecar's handlers."""

    def __init__(
        self,
        engine_url: str,
        allow: AllowList,
        proxy: ProxyConfig,
        allow_client_handoff_fields: bool = False,
    ) -> None:
        self.engine_url = engine_url.rstrip("/")
        self.allow = allow
        self.proxy = proxy
        self.owned = OwnedFields(trusted=allow_client_handoff_fields)
        self.upstream: Upstream | None = None

    async def start(self) -> None:
        self.upstream = Upstream(self.proxy)

    async def close(self) -> None:
        if self.upstream is not None:
            await self.upstream.close()

    def routes(self) -> list[web.RouteDef]:
        return [
            *(web.post(path, self.generate) for path in _PATHS),
            web.get("/health", self.health),
            web.get("/{tail:.*}", self.passthrough),
        ]

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def _headers(self, request: web.Request) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        for name in ("X-Request-Id", "Authorization", "X-data-parallel-rank"):
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        return headers

    async def passthrough(self, request: web.Request) -> web.Response:
        """GETs (models, metrics, server info) go to the local engine as they are."""
        assert self.upstream is not None
        try:
            status, body = await self.upstream.get(
                self.engine_url + request.path_qs, self.proxy.first_byte_timeout_s
            )
        except UpstreamError as exc:
            raise ApiError(exc.http_status, f"local engine: {exc}") from None
        return web.Response(body=body, status=status, content_type="application/json")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id") or os.urandom(16).hex()
        try:
            return await self._generate(request, rid)
        except ApiError as err:
            return error_response(err, rid)

    async def _generate(self, request: web.Request, rid: str) -> web.StreamResponse:
        assert self.upstream is not None
        body = await read_body(request)
        payload: dict[str, Any] | None = None
        if not self.owned.trusted:  # trusted: the body goes on unread
            body, payload = self.owned.body(body)
        headers = {**self._headers(request), "X-Request-Id": rid}
        target = request.headers.get(HEADER)
        if target is None:
            return await self._relay(request, self.engine_url + request.path, body, headers, None)
        host, port = parse_target(target)
        if not self.allow.allows(host, port):
            log.warning("refused %s=%s: not on the allow-list", HEADER, target)
            raise ApiError(403, f"prefill target {host}:{port} is not allowed", param=HEADER)
        if payload is None:
            payload = decode_body(body)
        prefill_url = f"http://{host if ':' not in host else f'[{host}]'}:{port}{request.path}"
        try:
            status, data = await self.upstream.call(
                "POST",
                prefill_url,
                _encode(nixl.prefill_body(payload)),
                self.proxy.first_byte_timeout_s,
            )
        except UpstreamError as exc:
            log.warning("prefill leg to %s failed (%s); decoding locally", target, exc)
            status, data = 0, b""
        params = None
        cached = None
        if status == 200:
            try:
                answer = _decode(data)
            except msgspec.DecodeError:
                answer = {}
            if isinstance(answer, dict):
                params = nixl.returned_params(answer)
                cached = cached_tokens(answer)
        elif 400 <= status < 500:
            return web.Response(body=data, status=status, content_type="application/json")
        if params is not None and not self._side_channel_allowed(params, host):
            log.warning(
                "prefill engine %s names NIXL side channel %s:%s, which is not on the "
                "allow-list; decoding locally",
                target,
                params.get("remote_host"),
                params.get("remote_port"),
            )
            params = None
        decode_payload = nixl.decode_body(payload, params) if params else payload
        tap = UsageTap(cached_tokens=cached) if params else None
        return await self._relay(
            request, self.engine_url + request.path, _encode(decode_payload), headers, tap
        )

    def _side_channel_allowed(self, params: dict[str, object], prefill_host: str) -> bool:
        """The local engine may pull from the prefill host itself, or from an address the
        allow-list names (``ip:port`` pairs match the side channel's port too)."""
        host, port = params.get("remote_host"), params.get("remote_port")
        if host is None or host == prefill_host:
            return True
        return isinstance(host, str) and isinstance(port, int) and self.allow.allows(host, port)

    async def _relay(
        self,
        request: web.Request,
        url: str,
        body: bytes,
        headers: dict[str, str],
        tap: UsageTap | None,
    ) -> web.StreamResponse:
        assert self.upstream is not None
        try:
            call = await EngineCall.open(self.upstream, url, body, headers)
        except UpstreamError as exc:
            raise ApiError(exc.http_status, f"local engine: {exc}") from None
        sink = HttpDownstream(request, gone_at_end=lambda: log.debug(_GONE, url))
        with call:
            ctype = call.content_type
            if not ctype.startswith("text/event-stream"):
                data = await call.read()
                if tap is not None and call.status == 200:
                    data = tap.answer(data)
                await sink.whole(call.status, {"Content-Type": ctype}, data)
            else:
                head = {"Content-Type": ctype}
                await call.relay(sink, head, _LOCAL_STREAM, self.proxy.idle_timeout_s, tap=tap)
        assert sink.response is not None
        return sink.response


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", required=True, metavar="URL", help="the local decode engine")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one")
    parser.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="CIDR|IP:PORT",
        help="prefill targets the x-prefiller-host-port header may name (repeatable); "
        "none given: every request naming a prefiller is refused",
    )
    parser.add_argument(
        "--allow-client-handoff-fields",
        action="store_true",
        help="pass a client's own kv_transfer_params, ec_transfer_params and bootstrap_* "
        "fields (top level or nested) to the engine (default: removed; only for clients "
        "that run their own disaggregation)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (default info)",
    )


async def start_sidecar(
    engine_url: str,
    allow: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 0,
    proxy: ProxyConfig | None = None,
    server: ServerConfig | None = None,
    allow_client_handoff_fields: bool = False,
) -> tuple[web.AppRunner, Sidecar, str]:
    """Start a sidecar in the running loop; returns (runner, sidecar, its URL).

    ``server``: the listener's connection cap and timeouts (``ServerConfig``'s
    defaults, the router's, unless given)."""
    server = server or ServerConfig()
    guard = ConnectionGuard(
        server.max_connections,
        server.header_timeout_s,
        server.body_timeout_s,
        server.keepalive_timeout_s,
    )
    app = web.Application(middlewares=[guard.middleware, openai_errors])
    sidecar = Sidecar(
        engine_url, AllowList(allow), proxy or ProxyConfig(), allow_client_handoff_fields
    )
    app.add_routes(sidecar.routes())
    # The connections' protocol and its settings are the listener's
    # (router.frontends.http.listener).
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    try:
        bound = await bind(host, port, guard, runner)
    except BaseException:
        await runner.cleanup()
        raise
    await sidecar.start()
    bound_host, bound_port = bound.sockets[0].getsockname()[:2]
    await BoundSite(runner, bound, f"{bound_host}:{bound_port}").start()
    return runner, sidecar, f"http://{bound_host}:{bound_port}"


def server_settings(environ: Mapping[str, str]) -> ServerConfig:
    """The listener's cap and timeouts: ``ServerConfig``'s defaults, overridden by
    ``KVROUTE_SERVER__*`` variables as for ``kvroute serve`` (host and port are flags)."""
    prefix = f"{ENV_PREFIX}SERVER__"
    return load_config(environ={k: v for k, v in environ.items() if k.startswith(prefix)}).server


async def _serve(args: argparse.Namespace, server: ServerConfig) -> int:
    runner, sidecar, url = await start_sidecar(
        args.engine,
        args.allow,
        args.host,
        args.port,
        server=server,
        allow_client_handoff_fields=args.allow_client_handoff_fields,
    )
    print(f"kvroute sidecar listening on {url} (engine {args.engine})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await sidecar.close()
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        AllowList(args.allow)
    except ValueError as exc:
        print(f"kvroute sidecar: bad --allow entry: {exc}", file=sys.stderr)
        return 2
    try:
        server = server_settings(os.environ)
    except ConfigError as exc:
        print(f"kvroute sidecar: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        return asyncio.run(_serve(args, server))
    except ListenError as exc:
        print(f"kvroute sidecar: {exc.strerror}", file=sys.stderr)
        return 1
