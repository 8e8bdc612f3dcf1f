"""Who may publish on the router's bound KV-event socket (bind mode).

In bind mode (llm-d's central mode) engines connect to one SUB socket the router binds
and name themselves in the topic, ``kv@<ip>:<port>@<model>``. Without a check, anyone
who reaches the socket could post under any engine's topic: sequence numbers read as
restarts, ``AllBlocksCleared`` wiping the engine's entries, forged blocks. Two controls:

* **address binding** (``events.bind_check_address``, on by default): a message counts
  only if it comes from the address of the engine its topic names (``kv@10.0.0.5:8000@m``
  from 10.0.0.5, as libzmq reports the connection's peer); others are dropped and
  counted. It needs TCP: ``ipc://`` and ``inproc://`` peers are on the router's host.
* **CURVE** (``events.curve_secret_key_file`` with ``events.curve_public_keys_dir``):
  the socket is a CURVE server, and a ZAP handler (pyzmq's asyncio authenticator)
  admits only publishers holding one of the public keys in the directory (one shared
  key, or one per engine); a publisher with another key never completes its handshake,
  so none of its messages arrives. Refused handshakes are counted.

Keys are ZeroMQ certificate files, as ``zmq.auth.create_certificates`` writes them: a
``NAME.key`` with the public key and a ``NAME.key_secret`` with both (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from router.config import ConfigError

log = logging.getLogger("kvroute.events")

_WARN_EVERY_S = 60.0
"""At most one warning about refused publishers this often; every refusal is counted."""


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """The router's CURVE key pair and the public keys of the publishers it admits."""

    public: bytes
    secret: bytes
    publishers: frozenset[bytes]
    """Z85-encoded public keys, as ZeroMQ's certificate files hold them."""

    @classmethod
    def load(cls, secret_key_file: Path, public_keys_dir: Path) -> CurveKeys:
        """Read the key files; :class:`ConfigError` naming the setting if one is unusable
        (a configured key source that yields no key must not open the socket)."""
        try:
            public, secret = zmq.auth.load_certificate(secret_key_file)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"events.curve_secret_key_file: {exc}") from None
        if secret is None:
            raise ConfigError(
                f"events.curve_secret_key_file: {secret_key_file} holds no secret-key "
                "(give the NAME.key_secret file, not the public NAME.key)"
            )
        try:
            publishers = frozenset(zmq.auth.load_certificates(public_keys_dir))
        except OSError as exc:
            raise ConfigError(f"events.curve_public_keys_dir: {exc}") from None
        if not publishers:
            raise ConfigError(
                f"events.curve_public_keys_dir: {public_keys_dir} holds no public keys "
                "(NAME.key files); refusing to run with no publisher admitted"
            )
        return cls(public, secret, publishers)


@dataclass(frozen=True, slots=True)
class PublisherCurve:
    """A publisher's side of CURVE: its own key pair and the router's public key."""

    public: bytes
    secret: bytes
    server: bytes

    @classmethod
    def load(cls, key_file: str | Path, server_key_file: str | Path) -> PublisherCurve:
        """``key_file``: the publisher's ``NAME.key_secret``; ``server_key_file``: the
        router's public ``NAME.key``. ValueError if either is unusable."""
        try:
            public, secret = zmq.auth.load_certificate(key_file)
            server, _ = zmq.auth.load_certificate(server_key_file)
        except OSError as exc:
            raise ValueError(str(exc)) from None
        if secret is None:
            raise ValueError(f"{key_file} holds no secret-key (give the NAME.key_secret file)")
        return cls(public, secret, server)

    def secure(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` (before it connects) a CURVE client of the router."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server


class CurveGate:
    """CURVE on one bound socket: the router's keys on the socket, and the ZAP handler
    of its context admitting the configured publishers' keys.

    The context must be the bound socket's own: a ZAP handler serves every socket of
    its context."""

    def __init__(
        self, keys: CurveKeys, ctx: zmq.asyncio.Context, refused: Callable[[], None]
    ) -> None:
        """``refused`` is called for each handshake refused for an unknown key."""
        self.keys = keys
        self._refused = refused
        self._authenticator = AsyncioAuthenticator(ctx)
        self._warned_at: float | None = None
        self._unwarned = 0

    def start(self) -> None:
        self._authenticator.configure_curve_callback("*", self)
        self._authenticator.start()

    def secure(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` (before it binds) a CURVE server with the router's keys."""
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_server = True

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider call: may the publisher with ``key`` connect?"""
        if key in self.keys.publishers:
            return True
        self._refused()
        self._unwarned += 1
        now = time.monotonic()
        if self._warned_at is None or now - self._warned_at >= _WARN_EVERY_S:
            log.warning(
                "KV events: refused %d publisher handshake(s) since the last warning: "
                "CURVE key %s is not in events.curve_public_keys_dir (counted in "
                "kvroute_kv_event_publishers_refused_total)",
                self._unwarned,
                key.decode("ascii", "replace"),
            )
            self._warned_at = now
            self._unwarned = 0
        return False

    def stop(self) -> None:
        self._authenticator.stop()


def is_loopback(endpoint: str) -> bool:
    """Whether a bound endpoint takes connections from this host only (``ipc://``,
    ``inproc://``, or TCP on a loopback address)."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name, a host name: reachable from elsewhere
        return False


def same_address(peer: str, addresses: frozenset[str]) -> bool:
    """Whether ``peer`` (libzmq's Peer-Address of a TCP connection) is one of
    ``addresses`` (normalised by :func:`host_addresses`)."""
    try:
        return _normalised(peer) in addresses
    except ValueError:
        return False


async def host_addresses(endpoint: str) -> tuple[frozenset[str], bool]:
    """The addresses of an engine's ``host:port`` endpoint, and whether its host is an
    address itself (else a name, resolved now; no address if it does not resolve)."""
    host = endpoint.rpartition(":")[0].strip("[]")
    try:
        return frozenset({_normalised(host)}), True
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        log.warning("KV events: cannot resolve %s (%s): its messages are dropped", host, exc)
        return frozenset(), False
    return frozenset(_normalised(str(info[4][0])) for info in infos), False


def _normalised(address: str) -> str:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)
