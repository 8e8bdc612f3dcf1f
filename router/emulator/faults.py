"""Faults an emulated engine injects on command, so routers' failure handling can be tested.

Set at start-up by flags of ``kvroute engine`` and changed at run time through
``/admin/faults`` (docs/engine-emulator.md describes each). Request faults are read
when a request arrives, so changing them does not touch requests in flight. The two
KV-event counters are spent by the publishers, batch by batch, on every rank.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def _count(name: str, value: Any, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        kind = "a non-negative integer" + (" or null" if optional else "")
        raise ValueError(f"{name} must be {kind}, got {value!r}")


@dataclass
class Faults:
    """The faults in force on one engine server (all of its ranks)."""

    #: Fraction of generation requests answered 500 at once.
    fail_rate: float = 0.0
    #: Wall milliseconds added before a generation request reaches the engine.
    extra_latency_ms: float = 0.0
    #: Stop sending after this many output tokens but keep the connection open.
    stall_after_tokens: int | None = None
    #: Close the connection after this many output tokens.
    drop_after_tokens: int | None = None
    #: After this many output tokens send bytes that are not server-sent events (a
    #: stream) or cut the JSON answer short under a matching Content-Length (not).
    garble_after_tokens: int | None = None
    #: ``/health`` answers 503.
    fail_health: bool = False
    #: The next N KV-event batches are numbered and kept for replay but not published.
    kv_events_skip: int = 0
    #: The next N KV-event batches are each preceded by one malformed message.
    kv_events_garbage: int = 0

    def __post_init__(self) -> None:
        for name in ("fail_rate", "extra_latency_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if not 0.0 <= self.fail_rate <= 1.0:
            raise ValueError(f"fail_rate must be in [0, 1], got {self.fail_rate}")
        if self.extra_latency_ms < 0:
            raise ValueError(f"extra_latency_ms must not be negative, got {self.extra_latency_ms}")
        _count("stall_after_tokens", self.stall_after_tokens, optional=True)
        _count("drop_after_tokens", self.drop_after_tokens, optional=True)
        _count("garble_after_tokens", self.garble_after_tokens, optional=True)
        _count("kv_events_skip", self.kv_events_skip, optional=False)
        _count("kv_events_garbage", self.kv_events_garbage, optional=False)
        if not isinstance(self.fail_health, bool):
            raise ValueError(f"fail_health must be a boolean, got {self.fail_health!r}")

    def as_dict(self) -> dict[str, Any]:
        """The faults as ``/admin/faults`` shows them."""
        return dataclasses.asdict(self)

    def update(self, changes: Mapping[str, Any]) -> None:
        """Apply ``changes`` (field name → value) all at once, or none if one is invalid."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown fault {unknown[0]!r}; known: {', '.join(sorted(known))}")
        candidate = dataclasses.replace(self, **changes)  # validates
        for name in changes:
            setattr(self, name, getattr(candidate, name))

    def clear(self) -> None:
        """No faults at all."""
        self.update(dataclasses.asdict(Faults()))

    def fails_now(self, rng: random.Random) -> bool:
        """Draw whether this request is one of the ``fail_rate`` that fail."""
        return self.fail_rate > 0 and rng.random() < self.fail_rate

    def take_kv_skip(self) -> bool:
        """Spend one skipped KV-event batch, if any are left."""
        if self.kv_events_skip:
            self.kv_events_skip -= 1
            return True
        return False

    def take_kv_garbage(self) -> bool:
        """Spend one malformed KV-event message, if any are left."""
        if self.kv_events_garbage:
            self.kv_events_garbage -= 1
            return True
        return False
