"""The load view: what each engine is doing now, as far as the router can tell.

Two sources, kept apart because they age differently:

* the router's own in-flight accounting (exact and instant for this replica): requests,
  prompt tokens still to prefill, decode tokens still to generate, KV blocks pinned;
* values the engine reports on ``/metrics`` (waiting, running, KV usage), which include
  other routers' traffic but are as old as the last scrape.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from router.types import EngineKey


@dataclass(slots=True)
class EngineLoad:
    """One engine's load as the decision sees it."""

    requests: int = 0
    """In-flight requests routed there by this router (and, when shared, its peers)."""
    prefill_tokens: int = 0
    """Uncached prompt tokens of in-flight requests whose first token has not arrived."""
    decode_tokens: int = 0
    """Output tokens still to generate for in-flight requests (bounded by max_tokens)."""
    decode_blocks: int = 0
    """KV blocks in-flight decoding requests add to the engine: their uncached prompt blocks
    and their output blocks. Blocks of a prefix they share with cached or other requests
    are held once by the engine and are not counted again for each request."""
    waiting: float | None = None
    """Engine-reported queued requests (``vllm:num_requests_waiting``)."""
    running: float | None = None
    """Engine-reported running requests (``vllm:num_requests_running``)."""
    kv_usage: float | None = None
    """Engine-reported KV-cache usage in [0, 1] (``vllm:kv_cache_usage_perc``)."""
    reported_at: float | None = None
    """When the engine-reported values were scraped (router clock)."""
    routed: int = 0
    """Requests this router has sent there so far (orders otherwise equal choices)."""


LoadView = Mapping[EngineKey, EngineLoad]
_IDLE = EngineLoad()


def load_of(view: LoadView, engine: EngineKey) -> EngineLoad:
    """The engine's load, or an idle one if the view has none."""
    return view.get(engine, _IDLE)


@dataclass(slots=True)
class Ticket:
    """One routed request's contribution to its engine's load, until released."""

    id: int
    engine: EngineKey
    prefill_tokens: int
    decode_tokens: int
    blocks: int
    prefilled: bool = False
    released: bool = False


@dataclass(slots=True)
class LoadTracker:
    """The router's in-flight accounting per engine, plus the last scraped engine values.

    ``begin`` when a request is sent, ``prefilled`` when its first token arrives,
    ``end`` when it finishes, fails or its client leaves (``end`` is idempotent, so every
    exit path may call it).
    """

    block_size: int = 16
    on_end: Callable[[], None] | None = None
    """Called after a request's load is released (requests waiting for room retry)."""
    _loads: dict[EngineKey, EngineLoad] = field(default_factory=dict)
    _open: dict[int, Ticket] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=itertools.count)

    @property
    def view(self) -> LoadView:
        return self._loads

    def _load(self, engine: EngineKey) -> EngineLoad:
        load = self._loads.get(engine)
        if load is None:
            load = self._loads[engine] = EngineLoad()
        return load

    def begin(
        self, engine: EngineKey, prompt_tokens: int, cached_tokens: int, max_tokens: int
    ) -> Ticket:
        uncached = max(prompt_tokens - cached_tokens, 0)
        bs = self.block_size
        blocks = -(-uncached // bs) + -(-max(max_tokens, 0) // bs)
        ticket = Ticket(next(self._ids), engine, uncached, max(max_tokens, 0), blocks)
        load = self._load(engine)
        load.requests += 1
        load.routed = ticket.id + 1
        load.prefill_tokens += ticket.prefill_tokens
        load.decode_tokens += ticket.decode_tokens
        self._open[ticket.id] = ticket
        return ticket

    def prefilled(self, ticket: Ticket) -> None:
        """The first token arrived: the prompt is no longer queued prefill work."""
        if ticket.prefilled or ticket.released:
            return
        ticket.prefilled = True
        load = self._loads.get(ticket.engine)
        if load is None:  # the engine was forgotten while the request ran
            return
        load.prefill_tokens -= ticket.prefill_tokens
        load.decode_blocks += ticket.blocks

    def end(self, ticket: Ticket) -> None:
        if ticket.released:
            return
        ticket.released = True
        self._open.pop(ticket.id, None)
        load = self._loads.get(ticket.engine)
        if load is not None:
            load.requests -= 1
            load.decode_tokens -= ticket.decode_tokens
            if ticket.prefilled:
                load.decode_blocks -= ticket.blocks
            else:
                load.prefill_tokens -= ticket.prefill_tokens
        if self.on_end is not None:
            self.on_end()

    def report(
        self,
        engine: EngineKey,
        now: float,
        waiting: float | None = None,
        running: float | None = None,
        kv_usage: float | None = None,
    ) -> None:
        """Record values scraped from the engine's ``/metrics``."""
        load = self._load(engine)
        load.waiting, load.running, load.kv_usage, load.reported_at = (
            waiting,
            running,
            kv_usage,
            now,
        )

    def forget(self, engine: EngineKey) -> None:
        """Drop an engine that left the fleet; its open tickets release into nothing."""
        self._loads.pop(engine, None)

    @property
    def in_flight(self) -> int:
        return len(self._open)
