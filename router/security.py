"""Credentials, network allow-lists and TLS contexts (docs/security.md).

* :class:`Credentials`: the client and admin keys (``auth.*``), checked in constant
  time, and the ``Authorization`` engines are sent. Keys never reach logs, metrics or
  error messages: they live here as bytes and are only ever compared.
* :func:`engine_allowed`, :func:`endpoint_allowed`, :func:`engine_refused`: whether an
  address the router would connect to (an engine URL added at run time, its KV-event and
  replay endpoints, a NIXL side channel) lies in ``auth.engine_cidrs``.
* :class:`ServerTLS` / :func:`grpc_credentials`: TLS for the HTTP, gRPC and ext_proc
  listeners, with certificate files re-read when they change; :func:`client_tls` for
  engines with https URLs.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import ssl
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import urlsplit

import grpc

from router.config import (
    AuthConfig,
    ConfigError,
    EngineConfig,
    EventEndpoints,
    ProxyConfig,
    TlsConfig,
)
from router.serving.errors import anthropic_route

log = logging.getLogger("kvroute.security")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class AuthError(Exception):
    """A refused credential: 401 (none or unknown) or 403 (known, not allowed here)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def read_keys(inline: Iterable[object], path: Path | None, setting: str = "") -> list[bytes]:
    """Keys from the configuration and from a file (one per line, ``#`` comments).

    A source that is configured but yields no key (an empty or all-comment file, a
    list of blank keys) raises ConfigError naming ``setting``: with no keys the API it
    guards would be open, so a truncated Secret must not open it.
    """
    inline = list(inline)
    keys = [k for k in (_secret(k).strip().encode() for k in inline) if k]
    if inline and not keys:
        raise ConfigError(f"{setting}: every key is blank; refusing to run with no keys")
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read key file {path}: {exc.strerror}") from None
        from_file = [
            line.strip().encode()
            for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        ]
        if not from_file:
            raise ConfigError(
                f"{setting}_file: {path} holds no keys; refusing to run with no keys "
                f"(add a key, or remove {setting}_file)"
            )
        keys += from_file
    return keys


def _secret(value: object) -> str:
    getter = getattr(value, "get_secret_value", None)
    return getter() if getter is not None else str(value)


def key_digest(key: str) -> str:
    """A name for an API key (a tenant, a caller) that is never the key itself."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def bearer(authorization: str | None) -> bytes | None:
    """The token of ``Authorization: Bearer TOKEN`` (scheme case-insensitive)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip().encode()


def _matches(token: bytes, keys: list[bytes]) -> bool:
    """Constant time in the token and the number of keys (every key is compared)."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(token, key)
    return found


def peer_host(peer: str | None) -> str | None:
    """The host of a peer address (``127.0.0.1``, ``::1``, gRPC's ``ipv4:127.0.0.1:5000``,
    ``ipv6:[::1]:5000``); ``unix:...`` and None are returned as they are."""
    if not peer or not peer.startswith(("ipv4:", "ipv6:")):
        return peer
    host = peer[5:]
    return host[1 : host.index("]")] if host.startswith("[") else host.rsplit(":", 1)[0]


def is_loopback(peer: str | None) -> bool:
    """Whether a peer address (see :func:`peer_host`, or ``unix:...``) is this host."""
    host = peer_host(peer)
    if not host:
        return False
    if host.startswith("unix:"):
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


class Credentials:
    """The keys in force; ``reload`` swaps them (SIGHUP) without a restart."""

    def __init__(self, auth: AuthConfig) -> None:
        self.reload(auth)

    def reload(self, auth: AuthConfig) -> None:
        """Read every key (raises ConfigError, changing nothing, for an unreadable file or a
        configured source that yields no key)."""
        client = read_keys(auth.api_keys, auth.api_keys_file, "auth.api_keys")
        admin = read_keys(auth.admin_keys, auth.admin_keys_file, "auth.admin_keys")
        token = read_keys(
            [auth.upstream_token] if auth.upstream_token else [], None, "auth.upstream_token"
        )
        if auth.upstream_token_file is not None:
            token = read_keys([], auth.upstream_token_file, "auth.upstream_token")[:1]
        self.client, self.admin = client, admin
        self._upstream = f"Bearer {token[0].decode()}" if token else None
        self.upstream_mode = auth.upstream
        self.metrics_need_key = auth.metrics_need_key
        self.x_api_key = auth.accept_x_api_key

    @property
    def client_open(self) -> bool:
        """No client keys: the client API needs no credential."""
        return not self.client

    def accepts_x_api_key(self, path: str) -> bool:
        """Whether a client key may come as ``x-api-key`` on ``path``
        (``auth.accept_x_api_key``)."""
        return self.x_api_key == "all" or (self.x_api_key == "anthropic" and anthropic_route(path))

    def x_api_key_of(self, headers: Mapping[str, str], path: str) -> str | None:
        """The ``x-api-key`` a request to ``path`` carries, if accepted there."""
        return headers.get("x-api-key") if self.accepts_x_api_key(path) else None

    def check_http(self, headers: Mapping[str, str], path: str) -> None:
        """A client call over HTTP: its ``Authorization``, or its ``x-api-key`` where
        :meth:`accepts_x_api_key` (raises :class:`AuthError` 401)."""
        accepted = self.accepts_x_api_key(path)
        self.check_client(
            headers.get("authorization"), headers.get("x-api-key") if accepted else None, accepted
        )

    def check_client(
        self, authorization: str | None, x_api_key: str | None = None, hint: bool = False
    ) -> None:
        """A client call: any client or admin key (raises :class:`AuthError` 401), as
        ``Authorization: Bearer KEY`` or else ``x_api_key`` (``hint``: name that header
        in the refusal too)."""
        if not self.client:
            return
        token = bearer(authorization)
        if token is None and x_api_key and x_api_key.strip():
            token = x_api_key.strip().encode()
        if token is None:
            how = "'Authorization: Bearer <key>'" + (" or 'x-api-key: <key>'" if hint else "")
            raise AuthError(401, f"missing API key: send {how}")
        if not (_matches(token, self.client) | _matches(token, self.admin)):
            raise AuthError(401, "invalid API key")

    def check_admin(self, authorization: str | None, peer: str | None) -> None:
        """An admin call: an admin key (a client key is 403), or, with no admin keys
        configured, a caller on loopback."""
        if not self.admin:
            if is_loopback(peer):
                return
            raise AuthError(
                403,
                "admin calls are accepted from loopback only until auth.admin_keys (or "
                "auth.admin_keys_file) is set",
            )
        token = bearer(authorization)
        if token is None:
            raise AuthError(401, "missing admin key: send 'Authorization: Bearer <key>'")
        if _matches(token, self.admin):
            return
        if _matches(token, self.client):
            raise AuthError(403, "this key may not make admin calls")
        raise AuthError(401, "invalid admin key")

    def caller_of(self, headers: Mapping[str, str], path: str, peer: str | None) -> str:
        """Who makes a client call, for per-caller limits: the API key it presented
        (digested) when the router checks keys, else its network address (a header
        anyone may set names nobody)."""
        if self.client:
            token = bearer(headers.get("authorization"))
            key = token.decode() if token else (self.x_api_key_of(headers, path) or "").strip()
            if key:
                return key_digest(key)
        return f"peer:{peer_host(peer) or '?'}"

    def upstream_authorization_of(self, headers: Mapping[str, str], path: str) -> str | None:
        """:meth:`upstream_authorization` for a client's call to ``path`` with
        ``headers``."""
        return self.upstream_authorization(
            headers.get("authorization"), self.x_api_key_of(headers, path)
        )

    def upstream_authorization(
        self, client: str | None, x_api_key: str | None = None
    ) -> str | None:
        """The ``Authorization`` header engines are sent (``auth.upstream``).

        ``pass`` passes the client's key: its ``Authorization``, or else the
        ``x_api_key`` it was accepted with, as ``Bearer`` (engines read no other header).
        """
        if self.upstream_mode == "pass":
            if client is None and x_api_key and x_api_key.strip():
                return f"Bearer {x_api_key.strip()}"
            return client
        if self.upstream_mode == "token":
            return self._upstream
        return None


# --------------------------------------------------------------------------- networks


def networks(cidrs: Iterable[str]) -> list[Network]:
    return [ipaddress.ip_network(c, strict=False) for c in cidrs]


async def engine_allowed(url: str, cidrs: Iterable[str]) -> str | None:
    """None if every address ``url``'s host resolves to lies in ``cidrs``, else why not."""
    host = urlsplit(url).hostname
    if not host:
        return f"{url!r} has no host"
    return await host_allowed(host, cidrs)


async def host_allowed(host: str, cidrs: Iterable[str]) -> str | None:
    """None if every address ``host`` (a name or a literal address) resolves to lies in
    ``cidrs``, else why not."""
    allowed = networks(cidrs)
    try:
        addresses = [ipaddress.ip_address(host.strip("[]").split("%", 1)[0])]
    except ValueError:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, None, type=socket.SOCK_STREAM
            )
        except OSError as exc:
            return f"cannot resolve {host!r}: {exc.strerror or exc}"
        addresses = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]
    for address in addresses:
        if not any(address in net for net in allowed if net.version == address.version):
            return f"{host} ({address}) is outside auth.engine_cidrs"
    return None


_LOOPBACK = (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))


def zmq_host(endpoint: str) -> str | None:
    """The host a ``tcp://host:port`` ZMQ endpoint connects to; None for any other form
    (``ipc://``, ``inproc://``, other transports, ZMQ's ``source;destination`` syntax)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp" or ";" in rest:
        return None
    try:
        return urlsplit(f"tcp://{rest}").hostname
    except ValueError:
        return None


async def endpoint_allowed(
    endpoint: str, cidrs: Iterable[str], own_host: str | None = None
) -> str | None:
    """None if the router may connect to a KV-event (or replay) ZMQ endpoint, else why not.

    ``tcp://`` hosts must resolve into ``cidrs``, unless the host is ``own_host`` (the
    engine's own, already allowed or configured); ``ipc://`` and ``inproc://`` stay on
    this host, so they need loopback in ``cidrs``; other transports are refused.
    """
    cidrs = list(cidrs)
    scheme = endpoint.partition("://")[0]
    if scheme in ("ipc", "inproc"):
        nets = networks(cidrs)
        if any(a in net for a in _LOOPBACK for net in nets if net.version == a.version):
            return None
        return f"{endpoint!r} is on this host, and auth.engine_cidrs has no loopback network"
    host = zmq_host(endpoint)
    if not host:
        return f"{endpoint!r} is not a tcp://host:port, ipc:// or inproc:// endpoint"
    if own_host is not None and host == own_host:
        return None
    return await host_allowed(host, cidrs)


async def engine_refused(cfg: EngineConfig, cidrs: Iterable[str]) -> str | None:
    """Why an engine added at run time may not be added (its URL or an explicit KV-event
    or replay endpoint outside ``cidrs``), or None."""
    cidrs = list(cidrs)
    refused = await engine_allowed(cfg.url, cidrs)
    if refused is not None:
        return refused
    if isinstance(cfg.kv_events, EventEndpoints):
        for endpoint in (cfg.kv_events.endpoint, cfg.kv_events.replay_endpoint):
            if endpoint is not None:
                refused = await endpoint_allowed(endpoint, cidrs)
                if refused is not None:
                    return f"kv_events: {refused}"
    return None


# --------------------------------------------------------------------------- TLS


def _mtimes(paths: Iterable[Path | None]) -> tuple[float, ...]:
    out = []
    for path in paths:
        try:
            out.append(os.stat(path).st_mtime if path is not None else 0.0)
        except OSError:
            out.append(-1.0)
    return tuple(out)


class ServerTLS:
    """An ``ssl.SSLContext`` for the HTTP listener whose certificate follows its files.

    ``load_cert_chain`` on the live context changes what new handshakes present;
    connections already open keep theirs.
    """

    def __init__(self, cfg: TlsConfig) -> None:
        assert cfg.cert_file is not None and cfg.key_file is not None
        self.cfg = cfg
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        if cfg.client_ca_file is not None and cfg.client_auth_http:
            self.context.verify_mode = ssl.CERT_REQUIRED
            self.context.load_verify_locations(cafile=str(cfg.client_ca_file))
        self._files = (cfg.cert_file, cfg.key_file)
        self._seen: tuple[float, ...] = ()
        self.reloads = 0
        self.load()

    def load(self) -> None:
        try:
            self.context.load_cert_chain(str(self.cfg.cert_file), str(self.cfg.key_file))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load tls.cert_file / tls.key_file: {exc}") from None
        self._seen = _mtimes(self._files)

    def maybe_reload(self) -> bool:
        """Re-read the files if they changed; keep the old certificate if they are bad."""
        if _mtimes(self._files) == self._seen:
            return False
        try:
            self.load()
        except ConfigError as exc:
            log.error("%s; still serving the previous certificate", exc)
            self._seen = _mtimes(self._files)
            return False
        self.reloads += 1
        log.info("TLS certificate reloaded from %s", self.cfg.cert_file)
        return True

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.reload_interval_s)
            self.maybe_reload()


def grpc_credentials(cfg: TlsConfig) -> grpc.ServerCredentials:
    """Server credentials whose certificate follows its files (checked per handshake,
    at most every ``reload_interval_s``); client certificates required when
    ``client_ca_file`` is set."""
    assert cfg.cert_file is not None and cfg.key_file is not None
    files = (cfg.cert_file, cfg.key_file, cfg.client_ca_file)

    def configuration() -> grpc.ServerCertificateConfiguration:
        try:
            pair = (Path(cfg.key_file).read_bytes(), Path(cfg.cert_file).read_bytes())  # type: ignore[arg-type]
            roots = Path(cfg.client_ca_file).read_bytes() if cfg.client_ca_file else None
        except OSError as exc:
            raise ConfigError(f"cannot read TLS files: {exc}") from None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=roots)

    state = {"seen": _mtimes(files), "checked": 0.0}

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        now = time.monotonic()
        if now - state["checked"] < cfg.reload_interval_s:  # type: ignore[operator]
            return None
        state["checked"] = now
        seen = _mtimes(files)
        if seen == state["seen"]:
            return None
        state["seen"] = seen
        try:
            new = configuration()
        except ConfigError as exc:
            log.error("%s; the gRPC listeners keep the previous certificate", exc)
            return None
        log.info("gRPC TLS certificate reloaded from %s", cfg.cert_file)
        return new

    return grpc.dynamic_ssl_server_credentials(
        configuration(), fetch, require_client_authentication=cfg.client_ca_file is not None
    )


def client_tls(proxy: ProxyConfig) -> ssl.SSLContext:
    """The context for engines with https URLs (``proxy.ca_file``, ``verify_tls``,
    ``client_cert_file``)."""
    try:
        context = ssl.create_default_context(
            cafile=str(proxy.ca_file) if proxy.ca_file is not None else None
        )
        if proxy.client_cert_file is not None:
            key = proxy.client_key_file or proxy.client_cert_file
            context.load_cert_chain(str(proxy.client_cert_file), str(key))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the TLS files of proxy.*: {exc}") from None
    if not proxy.verify_tls:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
