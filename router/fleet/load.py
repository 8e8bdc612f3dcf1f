"""The load view: what each engine is doing now, as far as the router can tell.

Two sources, kept apart because they age differently:

* in-flight accounting: requests, prompt tokens still to prefill, decode tokens still
  to generate, KV blocks pinned. This router's own part is exact and instant; with
  replicas sharing Redis, the peers' part (``peer_*``) is added in by a background task
  (``router/fleet/shared_load.py``) about every 100 ms, and in between as each peer's
  changes arrive on the decision stream, so the fields every policy reads are totals
  over the replicas and no decision merges anything;
* values the engine reports on ``/metrics`` (waiting, running, KV usage), which include
  other routers' traffic but are as old as the last scrape.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from router.fleet.latency import EngineLatency, LatencyModel
from router.metric_catalogue import (
    ENGINE_INFLIGHT_REQUESTS,
    ENGINE_PEER_INFLIGHT_REQUESTS,
    ENGINE_PEER_QUEUED_PREFILL_TOKENS,
    ENGINE_QUEUED_PREFILL_TOKENS,
)
from router.types import EngineKey

if TYPE_CHECKING:
    from router.flow.ticket import FlowTicket
    from router.metric_catalogue import StateFamily


#: What a request is expected to generate before an engine's answers have been counted:
#: no bound but its own ``max_tokens``.
PRIOR_OUTPUT_TOKENS = math.inf
#: The weight of each counted answer in :attr:`EngineLoad.output_tokens` (about the last
#: twenty answers).
OUTPUT_WEIGHT = 0.05

#: The window of :meth:`EngineLoad.offered_tokens_per_s`: long enough to average over a
#: handful of requests, short enough to follow a burst (the routing results of
#: ``kvroute simulate --matrix`` barely move between 1 and 5 s).
OFFERED_HALF_LIFE_S = 2.0
_LN2 = math.log(2.0)


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
    peer_requests: int = 0
    """The part of ``requests`` other router replicas reported (the same for the three
    fields after it); this router's own part is the difference."""
    peer_prefill_tokens: int = 0
    peer_decode_tokens: int = 0
    peer_decode_blocks: int = 0
    decoding: int = 0
    """This router's in-flight requests there whose first token has arrived (sequences
    decoding; not exchanged with peers)."""
    backlog_until: float = 0.0
    """When this router's queued prefill there is predicted to be done (tracker clock):
    each request sent extends it by its prefill at the fitted speed, each first token
    re-anchors it to what the engine really did. Kept with a latency model."""
    latency: EngineLatency | None = None
    """The engine's fitted latency lines (:mod:`router.fleet.latency`), when the
    tracker keeps a model."""
    offered: float = 0.0
    """Uncached prompt tokens this router has sent there, each weighing half as much
    every :data:`OFFERED_HALF_LIFE_S` since it was sent (as of :attr:`offered_at`): the
    prefill work offered to the engine lately (:meth:`offered_tokens_per_s`)."""
    offered_at: float = 0.0
    replicas: int = 1
    """Router replicas whose work this router's share of :attr:`offered` stands for (1 +
    the peers of the last load exchange): each sends about as much."""
    output_tokens: float = PRIOR_OUTPUT_TOKENS
    """The output tokens of the requests that ended there lately, counted (a streamed
    answer's), as a moving mean (infinite until one is): what a request there is expected
    to generate when its ``max_tokens`` allows more (clients often send a cap far above
    the answer)."""

    def offered_tokens_per_s(self, now: float) -> float:
        """Prefill tokens per second offered to the engine lately, by this router and (as
        many again each) its peers."""
        if not self.offered:
            return 0.0
        age = now - self.offered_at
        kept = self.offered * 0.5 ** (age / OFFERED_HALF_LIFE_S) if age > 0 else self.offered
        return kept * self.replicas * _LN2 / OFFERED_HALF_LIFE_S

    def copy(self) -> EngineLoad:
        return dataclasses.replace(self)

    def own(self) -> InFlight:
        """This router's own in-flight work there (the totals less the peers' part)."""
        return InFlight(
            self.requests - self.peer_requests,
            self.prefill_tokens - self.peer_prefill_tokens,
            self.decode_tokens - self.peer_decode_tokens,
            self.decode_blocks - self.peer_decode_blocks,
        )

    def set_peers(self, peers: InFlight) -> None:
        """Replace the peers' part of the totals."""
        self.requests += peers.requests - self.peer_requests
        self.prefill_tokens += peers.prefill_tokens - self.peer_prefill_tokens
        self.decode_tokens += peers.decode_tokens - self.peer_decode_tokens
        self.decode_blocks += peers.decode_blocks - self.peer_decode_blocks
        self.peer_requests = peers.requests
        self.peer_prefill_tokens = peers.prefill_tokens
        self.peer_decode_tokens = peers.decode_tokens
        self.peer_decode_blocks = peers.decode_blocks


class InFlight(NamedTuple):
    """In-flight work on one engine: what replicas exchange through Redis."""

    requests: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    decode_blocks: int = 0

    def plus(self, other: InFlight) -> InFlight:
        """Both engines' (or replicas') work together."""
        return InFlight(
            self.requests + other.requests,
            self.prefill_tokens + other.prefill_tokens,
            self.decode_tokens + other.decode_tokens,
            self.decode_blocks + other.decode_blocks,
        )


NO_PEERS = InFlight()


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
    flow: FlowTicket | None = None
    """The request's flow-control ticket (``flow.enabled``): prefill isolation reads it."""
    started: float = 0.0
    """When it was sent (the tracker's clock), for tickets with a ``flow``."""
    estimated: bool = False
    """Its first token may never be seen (a non-streamed answer, a gateway's pick): prefill
    isolation estimates when its prefill ends."""
    sent_at: float = 0.0
    """When it was sent (the tracker's clock)."""
    ahead: int = 0
    """Prefill tokens queued on the engine when it was sent (the latency model's x)."""
    timed: bool = False
    """Its first-token time teaches the latency model (its output pace does whenever the
    caller counts its tokens: :attr:`output_tokens`)."""
    first_at: float = -1.0
    """When its first token arrived (tracker clock; -1: not yet, or no model)."""
    decoding_at_first: int = 0
    """Sequences decoding on the engine when its first token arrived (itself included)."""
    done_by: float = 0.0
    """When its prefill was predicted to be done (the backlog after it)."""
    prefill_s: float = 0.0
    """Its own prefill's predicted seconds (its share of the backlog)."""
    output_tokens: int | None = None
    """Output tokens it produced, when the caller counted them (the TPOT observation)."""


@dataclass(slots=True)
class LoadTracker:
    """The router's in-flight accounting per engine, plus the last scraped engine values.

    ``begin`` when a request is sent, ``prefilled`` when its first token arrives,
    ``end`` when it finishes, fails or its client leaves (``end`` is idempotent, so every
    exit path may call it).
    """

    block_size: int = 16
    on_end: Callable[[], None] | None = None
    """Called after a request's load is released, and after the first token of one with
    a flow ticket (requests waiting for room, or yielding to its prefill, retry)."""
    clock: Callable[[], float] = time.monotonic
    on_change: Callable[[EngineKey], None] | None = None
    """Called with the engine whenever this router's own work on it changed (a request
    sent, its first token, its end): the replicas' load sharing sends such changes at
    once (:meth:`~router.fleet.shared_load.SharedLoad.changed`)."""
    track_prefills: bool = False
    """Keep :attr:`prefilling` (prefill isolation is on)."""
    prefilling: dict[EngineKey, dict[int, Ticket]] = field(default_factory=dict)
    """Engine -> tickets with a flow ticket whose first token has not arrived (prefill
    isolation, :mod:`router.flow.isolation`); engines with none are left out."""
    latency: LatencyModel | None = None
    """The online latency model (:mod:`router.fleet.latency`) the tracker feeds with
    first-token times and output pace; None keeps none."""
    replicas: int = 1
    """Router replicas sharing the engines, this one included (:meth:`set_replicas`)."""
    _loads: dict[EngineKey, EngineLoad] = field(default_factory=dict)
    _open: dict[int, Ticket] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=itertools.count)

    @property
    def view(self) -> LoadView:
        return self._loads

    def _load(self, engine: EngineKey) -> EngineLoad:
        load = self._loads.get(engine)
        if load is None:
            load = self._loads[engine] = EngineLoad(replicas=self.replicas)
            if self.latency is not None:
                load.latency = self.latency.of(engine)
        return load

    def begin(
        self,
        engine: EngineKey,
        prompt_tokens: int,
        cached_tokens: int,
        max_tokens: int,
        flow: FlowTicket | None = None,
        *,
        sees_first_token: bool = True,
        timed: bool | None = None,
    ) -> Ticket:
        """``flow``: the request's flow-control ticket, if flow control admitted it;
        ``sees_first_token``: whether :meth:`prefilled` will be called when the first
        token arrives (a streamed answer), rather than only at the end; ``timed``:
        whether its first-token time is the engine's own prefill, to teach the latency
        model (default ``sees_first_token``; False for a decode leg whose KV another
        engine prefilled)."""
        uncached = max(prompt_tokens - cached_tokens, 0)
        bs = self.block_size
        blocks = -(-uncached // bs) + -(-max(max_tokens, 0) // bs)
        ticket = Ticket(next(self._ids), engine, uncached, max(max_tokens, 0), blocks)
        if flow is not None and uncached and self.track_prefills:
            ticket.flow = flow
            ticket.started = self.clock()
            ticket.estimated = not sees_first_token
            self.prefilling.setdefault(engine, {})[ticket.id] = ticket
        load = self._load(engine)
        if uncached:
            at = self.clock()
            if load.offered and at > load.offered_at:
                load.offered *= 0.5 ** ((at - load.offered_at) / OFFERED_HALF_LIFE_S)
            load.offered += uncached
            load.offered_at = max(at, load.offered_at)
        if self.latency is not None:
            ticket.timed = sees_first_token if timed is None else timed
            now = ticket.sent_at = self.clock()
            ticket.ahead = load.prefill_tokens
            if load.latency is not None:
                start = max(now, load.backlog_until)
                ticket.prefill_s = load.latency.prefill_s_per_token * uncached
                ticket.done_by = start + ticket.prefill_s
                load.backlog_until = ticket.done_by
        load.requests += 1
        load.routed = ticket.id + 1
        load.prefill_tokens += ticket.prefill_tokens
        load.decode_tokens += ticket.decode_tokens
        self._open[ticket.id] = ticket
        if self.on_change is not None:
            self.on_change(engine)
        return ticket

    def prefilled(self, ticket: Ticket) -> None:
        """The first token arrived: the prompt is no longer queued prefill work."""
        if ticket.prefilled or ticket.released:
            return
        ticket.prefilled = True
        if ticket.flow is not None and self.unprefill(ticket) and self.on_end is not None:
            self.on_end()
        load = self._loads.get(ticket.engine)
        if load is None:  # the engine was forgotten while the request ran
            return
        load.prefill_tokens -= ticket.prefill_tokens
        load.decode_blocks += ticket.blocks
        load.decoding += 1
        if self.on_change is not None:
            self.on_change(ticket.engine)
        if load.latency is None:
            return
        now = ticket.first_at = self.clock()
        ticket.decoding_at_first = load.decoding
        # Everything queued behind it is as late (or early) as it was.
        load.backlog_until = (
            max(now, load.backlog_until + now - ticket.done_by)
            if load.prefill_tokens > load.peer_prefill_tokens
            else now
        )
        if ticket.timed:
            load.latency.observe_ttft(
                now, ticket.ahead + ticket.prefill_tokens, max(now - ticket.sent_at, 0.0)
            )

    def end(self, ticket: Ticket) -> None:
        if ticket.released:
            return
        ticket.released = True
        self._open.pop(ticket.id, None)
        if ticket.flow is not None:
            self.unprefill(ticket)
        load = self._loads.get(ticket.engine)
        if load is not None:
            load.requests -= 1
            load.decode_tokens -= ticket.decode_tokens
            if ticket.prefilled:
                load.decode_blocks -= ticket.blocks
                if ticket.output_tokens is not None:
                    counted = ticket.output_tokens
                    mean = load.output_tokens
                    load.output_tokens = (
                        counted if math.isinf(mean) else mean + OUTPUT_WEIGHT * (counted - mean)
                    )
                if ticket.first_at >= 0 and load.latency is not None:
                    self._observe_pace(ticket, load)
                load.decoding -= 1
            else:
                load.prefill_tokens -= ticket.prefill_tokens
                if load.latency is not None:  # its prefill will not be done there
                    now = self.clock()
                    if load.prefill_tokens <= load.peer_prefill_tokens:
                        load.backlog_until = now
                    elif ticket.done_by > now:
                        # What was left of its own prefill: the queue behind it moves up.
                        left = min(ticket.prefill_s, ticket.done_by - now)
                        load.backlog_until = max(now, load.backlog_until - left)
            if self.on_change is not None:
                self.on_change(ticket.engine)
        if self.on_end is not None:
            self.on_end()

    def _observe_pace(self, ticket: Ticket, load: EngineLoad) -> None:
        """Teach the latency model the output pace of a request that ran to its end:
        seconds per token after the first, against the sequences decoding there (the
        mean of when its first token came and now)."""
        tokens = ticket.output_tokens
        if tokens is None or tokens < 2 or load.latency is None:
            return
        now = self.clock()
        seqs = (ticket.decoding_at_first + load.decoding) / 2
        load.latency.observe_tpot(now, seqs, (now - ticket.first_at) / (tokens - 1))

    def unprefill(self, ticket: Ticket) -> bool:
        """Take ``ticket`` out of :attr:`prefilling` (its prefill is over, or was
        estimated to be); whether it was there."""
        mine = self.prefilling.get(ticket.engine)
        if mine is None or mine.pop(ticket.id, None) is None:
            return False
        if not mine:
            del self.prefilling[ticket.engine]
        return True

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
        """Drop an engine that left the fleet; its open tickets release into nothing
        (so that an engine added again under the same key starts from zero)."""
        self._loads.pop(engine, None)
        self.prefilling.pop(engine, None)
        if self.latency is not None:
            self.latency.forget(engine)
        for ticket in [t for t in self._open.values() if t.engine == engine]:
            ticket.released = True
            del self._open[ticket.id]

    def own(self) -> dict[EngineKey, InFlight]:
        """This router's own in-flight work per engine (engines with some)."""
        out = {}
        for engine, load in self._loads.items():
            mine = load.own()
            if any(mine):
                out[engine] = mine
        return out

    def set_peers(self, peers: Mapping[EngineKey, InFlight]) -> None:
        """Make the other replicas' in-flight work part of the totals: ``peers`` holds
        it per engine; engines it leaves out have none. Engines this tracker has never
        seen are added (the caller passes only engines of this router's fleet)."""
        for engine, load in self._loads.items():
            if engine not in peers:
                load.set_peers(NO_PEERS)
        for engine, work in peers.items():
            self._load(engine).set_peers(work)

    def set_replicas(self, count: int) -> None:
        """How many router replicas send work to these engines, this one included (the
        load exchange counts them): each engine's offered load is this router's share
        times that."""
        self.replicas = max(count, 1)
        for load in self._loads.values():
            load.replicas = self.replicas

    def set_peer(self, engine: EngineKey, work: InFlight) -> None:
        """Replace the other replicas' in-flight work on one engine (a change a peer
        sent on the stream); the caller passes only engines of this router's fleet."""
        self._load(engine).set_peers(work)

    @property
    def in_flight(self) -> int:
        return len(self._open)

    def metric_families(
        self, engines: Sequence[EngineKey], peers: bool = False
    ) -> Iterator[StateFamily]:
        """This router's in-flight requests and queued prefill tokens on each of
        ``engines`` (the fleet's: a series goes with its engine), the other replicas'
        too when ``peers`` (load is shared), then the latency model's lines."""
        inflight = ENGINE_INFLIGHT_REQUESTS.labelled()
        prefill = ENGINE_QUEUED_PREFILL_TOKENS.labelled()
        peer_inflight = ENGINE_PEER_INFLIGHT_REQUESTS.labelled()
        peer_prefill = ENGINE_PEER_QUEUED_PREFILL_TOKENS.labelled()
        for key in engines:
            load = self._loads.get(key)
            own = load.own() if load else None
            inflight.add_metric([key.label], own.requests if own else 0)
            prefill.add_metric([key.label], own.prefill_tokens if own else 0)
            peer_inflight.add_metric([key.label], load.peer_requests if load else 0)
            peer_prefill.add_metric([key.label], load.peer_prefill_tokens if load else 0)
        yield inflight
        yield prefill
        if peers:
            yield peer_inflight
            yield peer_prefill
        if self.latency is not None:
            now = self.clock()

            def offered(key: EngineKey) -> float:
                load = self._loads.get(key)
                return load.offered_tokens_per_s(now) if load is not None else 0.0

            yield from self.latency.metric_families(engines, offered)
