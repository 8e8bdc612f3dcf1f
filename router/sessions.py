"""Which engine served each session last: the ``latency`` policy's affinity map.

A bounded LRU of session key -> (engine, expiry). The policy notes its own choices;
with router replicas sharing Redis, its pins go out through :attr:`SessionMap.on_note`
and the peers' arrive through :meth:`SessionMap.learn` (router/index/replicated.py), so
the next turn of a conversation finds the engine the last one went to whichever
replica it reaches.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import xxhash

from router.types import EngineKey

#: Session keys longer than this are kept (and shared) as a 128-bit hash of themselves:
#: a client's key is any header or ``user`` value, and the map keeps it for minutes.
MAX_KEY_CHARS = 64


def session_key(session: str) -> str:
    """The key the map keeps for ``session``: itself when short, else its hash."""
    if len(session) <= MAX_KEY_CHARS:
        return session
    return "h:" + xxhash.xxh3_128_hexdigest(session.encode("utf-8", "surrogatepass"))


class SessionMap:
    """Session key -> the engine that served it last, for ``ttl_s`` (LRU beyond
    ``max_sessions``)."""

    def __init__(self, ttl_s: float = 600.0, max_sessions: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._pins: OrderedDict[str, tuple[EngineKey, float]] = OrderedDict()
        self.on_note: Callable[[str, EngineKey, float], None] | None = None
        """Told of each pin this router makes (session, engine, TTL): the Redis share."""

    def __len__(self) -> int:
        return len(self._pins)

    def get(self, session: str, now: float) -> EngineKey | None:
        pin = self._pins.get(session)
        if pin is None:
            return None
        if pin[1] <= now:
            del self._pins[session]
            return None
        return pin[0]

    def note(self, session: str, engine: EngineKey, now: float) -> None:
        """This router sent ``session`` to ``engine``."""
        self.learn(session, engine, now + self.ttl_s)
        if self.on_note is not None:
            self.on_note(session, engine, self.ttl_s)

    def learn(self, session: str, engine: EngineKey, expires: float) -> None:
        """``session`` went to ``engine`` (here or at a peer), until ``expires``."""
        pins = self._pins
        pins[session] = (engine, expires)
        pins.move_to_end(session)
        while len(pins) > self.max_sessions:
            pins.popitem(last=False)

    def forget(self, engine: EngineKey) -> None:
        """An engine left: its sessions go wherever the cost sends them."""
        for session in [s for s, (e, _) in self._pins.items() if e == engine]:
            del self._pins[session]


__all__ = ["MAX_KEY_CHARS", "SessionMap", "session_key"]
