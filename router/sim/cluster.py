"""The cluster simulator: the router's own decision code against engine models, on a
virtual clock.

Nothing here is a second router. Each request goes through the objects ``kvroute serve``
routes with: :class:`~router.core.RoutingCore` over a :class:`~router.index.memory.MemoryIndex`
(provisional holders included), the configured policy from :func:`~router.policy.make_policy`,
the :class:`~router.fleet.load.LoadTracker` in-flight accounting (a plan's legs charged
as every front end charges them, :mod:`router.serving.charges`), the router's request
plan (:class:`~router.plan.Planner`: the decode policy, the split decision and the
prefill choice for prefill/decode pools, over the fleet as :class:`SimPools`), and the
:class:`~router.events.ingest.EventIngestor` that turns the engines' KV events into index
writes. The engines are :class:`~router.engine_model.EngineModel`, the same object the
emulator serves over HTTP. Only the clock differs: a heap of timed events replaces
sockets and sleeping, so an hour of trace runs in seconds and every run is repeatable.

Modelled router-side effects: KV events reach the index ``event_lag_s`` after the step
that produced them (the ZMQ hop and the subscriber); decisions are recorded as
provisional holders with the live router's TTLs on the virtual clock; engine-reported
load (waiting, running, KV usage) is refreshed every ``scrape_interval_s``, as the
router's background scrape does. Routing itself takes no virtual time.

With ``replicas`` above 1 the fleet sits behind that many router replicas of the
replicated index mode, each request routed by one of them (``replica_pick``). Each
replica has its own index, load tracker, policy and planner: the engines' KV events
reach every replica after the same ``event_lag_s``; a replica's decisions are recorded
in its own index at once and reach the others' ``sync_delay_s`` later, as the same
expiring records with their ttl shortened by the delay; a replica knows its own
in-flight load exactly and its peers' as they were at the last exchange, one every
``load_interval_s``, or at their last change, which reaches the others ``sync_delay_s``
after it (``load_push``). What it costs shows in the run's replica split rate
(:func:`replica_split`) and turn stickiness.

A disaggregated request follows the NIXL dialect's timing: a prefill leg with
``max_tokens`` 1 on the prefill engine, whose blocks stay held; then the decode leg on
the decode engine, which allocates the prompt, waits for the transfer (bytes per token
over the link bandwidth) and decodes; the prefill engine's hold is released when the
decode leg has its KV.

With a :class:`Layout`, engines sit on racks of one zone (one engine per node) and the
router knows it (``engines[].topology``, as a live router would): a transfer between two
engines takes the link of their locality (``disaggregation.links``, the same numbers the
router prices with), and a transfer that leaves its rack shares the uplinks of both
racks with every other transfer crossing them at that moment (``uplink_gb_s`` each; the
share is fixed when the decode leg is sent). The router's cost does not see the contention:
only the simulated links pay it.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import statistics
import time
from array import array
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from router.config import DisaggregationConfig, PolicyConfig
from router.core import RoutingCore
from router.engine_model import EngineModel, EngineParams
from router.engine_model import RequestSpec as EngineRequest
from router.events.ingest import EventIngestor, StreamState
from router.events.types import EventBatch
from router.fleet.latency import LatencyModel
from router.fleet.load import InFlight, LoadTracker, Ticket
from router.hashing import block_keys, cacheable_blocks, seed_for
from router.index.base import IndexStats, KVIndex, Match, footprint
from router.index.memory import MemoryIndex
from router.plan import Planner
from router.policy import make_policy
from router.policy.base import RouteRequest
from router.policy.latency import priors_of
from router.serving.charges import Charges
from router.serving.planning import wire_planner
from router.tokenization.words import WordTokenizer
from router.topology import Topology, link_between
from router.types import EngineKey, Tier
from router.workloads.ceilings import ceiling_of_keys
from router.workloads.spec import RequestSpec, answer_tokens, spec_tokens
from router.workloads.stats import latency_stats

#: The model name requests carry (seeds the block keys, as in the live router).
MODEL = "kvroute-emulated"

_ARRIVE, _STEP, _DELIVER, _WAKE, _SYNC, _LOAD = range(6)
_words = WordTokenizer()


@dataclass(frozen=True, slots=True)
class Fleet:
    """How many engines of each role: ``engines`` colocated (role ``both``), or
    ``prefill`` + ``decode`` pools (disaggregated)."""

    engines: int = 0
    prefill: int = 0
    decode: int = 0

    def __post_init__(self) -> None:
        if self.engines < 0 or self.prefill < 0 or self.decode < 0:
            raise ValueError("engine counts must not be negative")
        if self.engines and (self.prefill or self.decode):
            raise ValueError("give either colocated engines or prefill + decode pools")
        if not self.engines and not self.decode:
            raise ValueError("a fleet needs colocated engines or at least one decode engine")

    @property
    def disaggregated(self) -> bool:
        return not self.engines

    @property
    def gpus(self) -> int:
        return self.engines + self.prefill + self.decode

    def describe(self) -> str:
        if self.engines:
            return f"{self.engines} colocated"
        return f"{self.prefill}P+{self.decode}D"


#: How a :class:`Layout` places the pools on racks.
LAYOUTS = ("packed", "spread")


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a fleet's engines sit: ``racks`` racks of one zone, one engine per node.

    ``packed``: every rack holds its share of both pools (prefill engine *i* and decode
    engine *i* on rack *i* mod ``racks``), as llm-d's ``packDomain: rack`` places each
    prefill/decode clique. ``spread``: engines fill the racks in order, the prefill pool
    first, as a scheduler placing each deployment where it has room does: the pools end
    up on different racks and transfers cross the spine.
    """

    racks: int = 2
    style: str = "packed"
    uplink_gb_s: float = 25.0
    """Capacity of each rack's link to the spine, shared by the transfers crossing it."""

    def __post_init__(self) -> None:
        if self.racks < 1:
            raise ValueError("a layout needs at least one rack")
        if self.style not in LAYOUTS:
            raise ValueError(f"layout {self.style!r}: choose one of {', '.join(LAYOUTS)}")
        if not self.uplink_gb_s > 0:
            raise ValueError("the rack uplink's capacity must be positive")

    def place(self, roles: Sequence[str]) -> list[Topology]:
        """Each engine's topology, for engines of ``roles`` in fleet order."""
        racks: list[int] = []
        if self.style == "packed":
            seen: Counter[str] = Counter()
            for role in roles:
                racks.append(seen[role] % self.racks)
                seen[role] += 1
        else:
            per_rack = math.ceil(len(roles) / self.racks)
            racks = [n // per_rack for n in range(len(roles))]
        return [Topology(f"node-{n}", f"rack-{r}", "zone-0") for n, r in enumerate(racks)]

    def describe(self) -> str:
        return f"{self.style} on {self.racks} racks ({self.uplink_gb_s:g} GB/s uplinks)"


#: How :class:`SimSettings` ``replica_pick`` spreads requests over router replicas.
REPLICA_PICKS = ("random", "round_robin")


@dataclass(frozen=True, slots=True)
class SimSettings:
    """Everything one simulated run depends on besides the workload."""

    fleet: Fleet
    params: EngineParams
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    #: Seconds from the step that produced a KV event to its arrival in the index.
    event_lag_s: float = 0.005
    #: Engines publish KV events; False: the index knows only the router's decisions.
    events: bool = True
    #: Seconds between refreshes of engine-reported load (the router's /metrics scrape).
    scrape_interval_s: float = 1.0
    #: Requests (conversations) in flight for workloads without arrival times.
    concurrency: int = 8
    #: Stop sending new closed-loop requests after this many virtual seconds.
    duration_s: float | None = None
    #: Racks and where the engines sit on them; None: no topology (one flat link).
    layout: Layout | None = None
    #: Router replicas in front of the fleet (the replicated index mode), each request
    #: routed by one of them.
    replicas: int = 1
    #: Seconds before a replica's decision records reach the other replicas' indexes.
    sync_delay_s: float = 0.0
    #: Seconds between the replicas' exchanges of their in-flight load per engine.
    load_interval_s: float = 0.1
    #: Between exchanges, each change of a replica's in-flight work on an engine reaches
    #: the others ``sync_delay_s`` later, on the decision stream (``index.redis.load_push``).
    load_push: bool = True
    #: Which replica routes a request: ``random`` (a hash of the request id, as a
    #: Kubernetes Service spreads connections) or ``round_robin`` (in arrival order).
    replica_pick: str = "random"
    #: The replica split rate's prefix group: the prompt's blocks that cover this many
    #: leading tokens (all of a shorter prompt's whole blocks).
    group_prefix_tokens: int = 1_024
    #: The replica split rate pairs requests of one prefix group at most this many
    #: seconds apart.
    burst_window_s: float = 1.0
    #: Engines that run slower than ``params`` say: the first ``slow_engines`` take
    #: ``slowdown`` times as long for every step (a throttled or older GPU), which only a
    #: router that times its engines can see.
    slow_engines: int = 0
    slowdown: float = 1.0

    def __post_init__(self) -> None:
        if self.slow_engines < 0 or not self.slowdown > 0:
            raise ValueError("slow engines must be >= 0 and their slowdown positive")
        if self.replicas < 1:
            raise ValueError("a fleet needs at least one router replica")
        if self.sync_delay_s < 0:
            raise ValueError("the replicas' sync delay must not be negative")
        if not self.load_interval_s > 0:
            raise ValueError("the replicas' load interval must be positive")
        if self.replica_pick not in REPLICA_PICKS:
            raise ValueError(
                f"replica pick {self.replica_pick!r}: choose one of {', '.join(REPLICA_PICKS)}"
            )
        if self.group_prefix_tokens < 1 or self.burst_window_s < 0:
            raise ValueError("the prefix group needs a token and the burst window >= 0 s")


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request, in virtual seconds."""

    arrival: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    """Prompt tokens the engine that prefilled it served from its cache."""
    engine: str
    """The engine that decoded it."""
    prefill_engine: str | None
    mode: str
    """``aggregated``, ``local`` (a disaggregated pool, one engine) or ``split``."""
    reason: str
    ttft: float
    e2e: float
    group: str = ""
    link: str = ""
    """Split requests with a layout: the locality of the prefill-to-decode link."""
    replica: int = 0
    """The router replica that routed it (0 with one router)."""
    order: int = 0
    """Its place in routing order (requests arriving at one moment are routed in turn)."""
    prefix_group: int | None = None
    """The block key of its first ``group_prefix_tokens`` tokens (chained: it names the
    whole prefix); None for a prompt shorter than one block."""
    previous_engine: str | None = None
    """A conversation's follow-up turn: the engine that served the previous turn."""


@dataclass(eq=False, slots=True)
class _Engine:
    key: EngineKey
    role: str
    model: EngineModel
    stream: StreamState
    topology: Topology | None = None
    busy: bool = False
    wake_at: float | None = None
    requests: int = 0
    prefill_tokens: int = 0
    """Prompt tokens this engine computed (not served from cache): its prefill work."""


class _EveryReplica(KVIndex):
    """The replicas' indexes as the event ingestor writes them.

    Every replica follows every engine's KV events itself, and they reach all of them
    after the same lag, so every replica's stream state (engine hash to block key) would
    be the same: one ingestor and one :class:`StreamState` per engine stand for them all,
    and each firm write lands in every replica's index. That is the per-replica ingest,
    with the block keys of each event computed once instead of once per replica.
    """

    def __init__(self, indexes: Sequence[MemoryIndex]) -> None:
        self.indexes = indexes

    async def lookup(
        self, keys: Sequence[int], candidates: Sequence[EngineKey]
    ) -> Mapping[EngineKey, Match]:
        return await self.indexes[0].lookup(keys, candidates)

    async def add(
        self,
        engine: EngineKey,
        keys: Sequence[int],
        tier: Tier = Tier.GPU,
        ttl: float | None = None,
    ) -> None:
        for index in self.indexes:
            index.add_now(engine, keys, tier, ttl)

    async def remove(
        self, engine: EngineKey, keys: Sequence[int], tier: Tier | None = None
    ) -> None:
        for index in self.indexes:
            index.remove_now(engine, keys, tier)

    async def clear(self, engine: EngineKey) -> None:
        for index in self.indexes:
            index.clear_now(engine)

    async def stats(self) -> IndexStats:
        return self.indexes[0].stats_now()


@dataclass(eq=False, slots=True)
class _Replica:
    """One router replica: what one ``kvroute serve`` process decides with."""

    number: int
    index: MemoryIndex
    loads: LoadTracker
    core: RoutingCore
    planner: Planner


@dataclass(eq=False, slots=True)
class _Flight:
    """One request on its way through the fleet."""

    rid: str
    spec: RequestSpec
    tokens: list[int]
    arrival: float
    mode: str
    reason: str
    serve: _Engine
    ticket: Ticket
    router: _Replica
    """The replica that routed it: its tickets live in that replica's load tracker."""
    order: int = 0
    previous: str | None = None
    """A follow-up turn: the engine that served the previous turn."""
    prefill: _Engine | None = None
    prefill_ticket: Ticket | None = None
    keys: Sequence[int] = ()
    """The prompt's block keys (kept for the ceiling; the tokens are not)."""
    cached: int = 0
    first_at: float | None = None
    last_at: float = 0.0
    output: list[int] = field(default_factory=list)
    link: str = ""
    uplinks: tuple[str, ...] = ()
    """Racks whose uplinks its transfer shares, until the decode leg has its KV."""


def _slowed(p: EngineParams, factor: float) -> EngineParams:
    """``p`` taking ``factor`` times as long for every step (``--slow-engines``)."""
    return p.replace(
        step_overhead_s=p.step_overhead_s * factor,
        prefill_token_s=p.prefill_token_s * factor,
        decode_seq_s=p.decode_seq_s * factor,
        context_token_s=p.context_token_s * factor,
    )


def routing_floor(
    sequences: Iterable[tuple[Sequence[int], int, Sequence[int]]],
    outputs: Iterable[int],
    params: EngineParams,
) -> dict[str, float | None]:
    """What no router can beat on a run's requests, whatever engine it picks: each
    request's TTFT is at least its own prefill on an idle engine with every block an
    earlier request computed (prompt or answer) served from cache, as one engine with an
    infinite cache holds them; each of its inter-token gaps is at least a decode step of
    that sequence alone (the step-time model of :class:`EngineParams` with no other
    sequence in the batch). ``sequences`` as :func:`ceiling_of_keys` takes them, in
    arrival order; ``outputs`` the tokens each produced. Percentiles interpolate as the
    run's own (:func:`latency_stats`), so a run whose every value is at or above its own
    floor has statistics at or above these.

    It holds for aggregated fleets: an engine that receives KV by transfer holds blocks
    no step of it computed, which the bound does not count."""
    bs = params.block_size
    seen: set[int] = set()
    ttft: list[float] = []
    spans: list[tuple[int, int]] = []
    """(first context, gaps): a request's gaps decode over contexts first .. first+gaps-1."""
    for (keys, length, computed), output in zip(sequences, outputs, strict=True):
        depth = 0
        for key in keys[: cacheable_blocks(length, bs)]:
            if key not in seen:
                break
            depth += 1
        seen.update(keys)
        seen.update(computed)
        own = length - depth * bs
        chunks = -(-own // params.max_num_batched_tokens)
        ttft.append(chunks * params.step_overhead_s + own * params.prefill_token_s)
        if output > 1:
            spans.append((length, output - 1))
    stats = latency_stats(ttft)
    floor: dict[str, float | None] = {
        "ttft_mean_s": stats["mean"],
        "ttft_p99_s": stats["p99"],
        "itl_mean_s": None,
        "itl_p99_s": None,
    }
    gaps = sum(n for _, n in spans)
    if not gaps:
        return floor
    step = params.step_overhead_s + params.decode_seq_s
    top = max(first + n - 1 for first, n in spans)

    def context_at(rank: int) -> int:
        """The ``rank``-th smallest context (1-based) over every gap."""
        low, high = 0, top
        while low < high:
            mid = (low + high) // 2
            if sum(min(max(mid - first + 1, 0), n) for first, n in spans) >= rank:
                high = mid
            else:
                low = mid + 1
        return low

    contexts = sum(n * first + n * (n - 1) // 2 for first, n in spans)
    position = (gaps - 1) * 0.99  # as the run's percentile: between two order statistics
    below = int(position)
    low, high = context_at(below + 1), context_at(min(below + 2, gaps))
    floor["itl_mean_s"] = step + params.context_token_s * contexts / gaps
    floor["itl_p99_s"] = step + params.context_token_s * (low + (high - low) * (position - below))
    return floor


@dataclass(slots=True)
class SimRun:
    """The outcome of one simulated run."""

    name: str
    settings: SimSettings
    records: list[RequestRecord]
    itl: array
    engines: list[dict[str, Any]]
    ceiling: float
    decisions: dict[str, int]
    preemptions: int
    index_events_skipped: int
    floor: dict[str, float | None] = field(default_factory=dict)
    """:func:`routing_floor` of its requests: latencies no router could go below (empty
    for a disaggregated fleet)."""
    errors: dict[str, int] = field(default_factory=dict)
    """Requests the engines refused, by reason (answered with an error, not served)."""
    wall_s: float = 0.0
    router_entries: int = 0
    """(block, engine, tier) records in the router's index at the end of the run."""
    router_expiring: int = 0
    """Of ``router_entries``, the provisional (expiring) records."""
    router_bytes: int = 0
    """What the router's index and its event streams' engine-hash maps take then: the
    compiled tables' own count of their arrays, or (pure Python) ``sys.getsizeof`` of
    their objects (:meth:`MemoryIndex.footprint`)."""
    measure_s: float = 0.0
    """Wall time spent measuring ``router_bytes`` (not part of the simulation)."""

    def summary(self) -> dict[str, Any]:
        """Every number of the run (seconds and ratios), shaped like ``kvroute bench``'s
        summaries so the same table code renders both."""
        recs = self.records
        prompt = sum(r.prompt_tokens for r in recs)
        cached = sum(r.cached_tokens for r in recs)
        output = sum(r.output_tokens for r in recs)
        start = min((r.arrival for r in recs), default=0.0)
        end = max((r.arrival + r.e2e for r in recs), default=0.0)
        span = end - start
        prefilling = [e for e in self.engines if e["role"] in ("both", "prefill")]
        serving = [e for e in self.engines if e["role"] in ("both", "decode")]
        return {
            "name": self.name,
            "policy": self.settings.policy.name,
            "fleet": self.settings.fleet.describe(),
            "gpus": self.settings.fleet.gpus,
            "requests": len(recs) + sum(self.errors.values()),
            "ok": len(recs),
            "errors": sum(self.errors.values()),
            "error_reasons": self.errors,
            "duration_s": span,
            "wall_s": self.wall_s,
            "request_throughput": len(recs) / span if span > 0 else None,
            "output_token_throughput": output / span if span > 0 else None,
            "ttft_s": latency_stats([r.ttft for r in recs]),
            "itl_s": latency_stats(self.itl),
            "e2e_s": latency_stats([r.e2e for r in recs]),
            "hit_rate": cached / prompt if prompt else None,
            "ceiling": self.ceiling,
            "floor": self.floor,
            "prefill_imbalance": _imbalance([e["prefill_tokens"] for e in prefilling]),
            "request_imbalance": _imbalance([e["requests"] for e in serving]),
            "split_share": (
                sum(r.mode == "split" for r in recs) / len(recs)
                if recs and self.settings.fleet.disaggregated
                else None
            ),
            "layout": self.settings.layout.describe() if self.settings.layout else None,
            "cross_rack_share": _cross_rack_share(recs) if self.settings.layout else None,
            "preemptions": self.preemptions,
            "decisions": self.decisions,
            "index_events_skipped": self.index_events_skipped,
            "router_index": {
                "entries": self.router_entries,
                "expiring": self.router_expiring,
                "bytes": self.router_bytes,
                "bytes_per_entry": (
                    self.router_bytes / self.router_entries if self.router_entries else None
                ),
            },
            "replicas": self.settings.replicas,
            "sync_delay_s": self.settings.sync_delay_s if self.settings.replicas > 1 else None,
            "load_interval_s": (
                self.settings.load_interval_s if self.settings.replicas > 1 else None
            ),
            "load_push": self.settings.load_push if self.settings.replicas > 1 else None,
            "replica_split": replica_split(recs, self.settings.burst_window_s),
            **turn_stickiness(recs),
            "engines": self.engines,
        }


class SimPools:
    """The simulated fleet as the planner's :class:`~router.plan.Pools`: one model,
    every engine healthy."""

    def __init__(self, disaggregated: bool) -> None:
        self.disaggregated = disaggregated
        self._engines: list[tuple[EngineKey, str]] = []
        self._where: dict[EngineKey, Topology] = {}

    def add(self, key: EngineKey, role: str, topology: Topology | None = None) -> None:
        self._engines.append((key, role))
        if topology is not None:
            self._where[key] = topology

    def topology_of(self, key: EngineKey) -> Topology | None:
        """Where the engine sits (the planner's ``locate``)."""
        return self._where.get(key)

    def candidates(
        self, model: str, roles: tuple[str, ...] = ("both",), exclude: Iterable[str] = ()
    ) -> list[EngineKey]:
        skip = set(exclude)
        return [k for k, role in self._engines if role in roles and k.endpoint not in skip]

    def is_disaggregated(self, model: str) -> bool:
        return self.disaggregated

    def models(self) -> list[str]:
        return [MODEL]


def _cross_rack_share(records: Sequence[RequestRecord]) -> float | None:
    """The share of split requests whose transfer left its rack."""
    links = [r.link for r in records if r.mode == "split"]
    return (
        sum(link not in ("same_node", "same_rack") for link in links) / len(links)
        if links
        else None
    )


def replica_split(records: Sequence[RequestRecord], window_s: float) -> dict[str, Any]:
    """How often requests of one prefix group arriving close together went to different
    engines, apart for pairs that two replicas routed and pairs that one did.

    Requests are taken in routing order; each is paired with the previous request of its
    prefix group (:attr:`RequestRecord.prefix_group`) when that one arrived at most
    ``window_s`` earlier. ``across`` is the share of the pairs routed by two different
    replicas that were served by different engines: the replica split rate, what replicas
    that had not yet heard of each other's decisions cost. ``within`` is the same share
    for pairs one replica routed: what the policy does anyway (load may spread a group),
    the baseline ``across`` is to be read against.
    """
    last: dict[int, RequestRecord] = {}
    across = across_moved = within = within_moved = 0
    for r in sorted(records, key=lambda r: r.order):
        group = r.prefix_group
        if group is None:
            continue
        prev = last.get(group)
        last[group] = r
        if prev is None or r.arrival - prev.arrival > window_s:
            continue
        moved = r.engine != prev.engine
        if r.replica != prev.replica:
            across += 1
            across_moved += moved
        else:
            within += 1
            within_moved += moved
    return {
        "pairs_across": across,
        "across": across_moved / across if across else None,
        "pairs_within": within,
        "within": within_moved / within if within else None,
    }


def turn_stickiness(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The share of conversations' follow-up turns served by the engine that served the
    previous turn (None without follow-up turns: traces carry no conversation)."""
    turns = [r for r in records if r.previous_engine is not None]
    same = sum(r.engine == r.previous_engine for r in turns)
    return {"follow_up_turns": len(turns), "turn_stickiness": same / len(turns) if turns else None}


def _imbalance(values: Sequence[float]) -> float | None:
    mean = statistics.fmean(values) if values else 0.0
    return max(values) / mean if mean > 0 else None


class ClusterSim:
    """One simulated fleet behind one router (or ``replicas`` of it); :meth:`run`
    replays a workload once."""

    def __init__(
        self, settings: SimSettings, name: str | None = None, endpoints: Sequence[str] = ()
    ) -> None:
        """``endpoints``: the engines' ``host:port`` names, prefill engines first
        (default ``sim-ROLE-N:8000``); a comparison with a live fleet gives the live
        names, so that ties (broken by a hash of the request id and the engine name) break
        alike."""
        if endpoints and len(endpoints) != settings.fleet.gpus:
            raise ValueError(f"{len(endpoints)} endpoints for {settings.fleet.gpus} engines")
        self.settings = settings
        self.name = name or settings.policy.name
        self.now = 0.0
        p = settings.params
        self.block_size = p.block_size
        self.pools = SimPools(settings.fleet.disaggregated)
        self.replicas = [self._replica(n) for n in range(settings.replicas)]
        # The first replica under the names the single router has always had.
        first = self.replicas[0]
        self.index, self.loads, self.core, self.planner = (
            first.index,
            first.loads,
            first.core,
            first.planner,
        )
        self._several = len(self.replicas) > 1
        self.ingestor = EventIngestor(
            _EveryReplica([r.index for r in self.replicas]) if self._several else self.index
        )
        self._turn = 0
        """Requests routed so far (the ``round_robin`` replica pick)."""
        self._next_exchange = 0.0
        """When the replicas next exchange their in-flight load."""
        self._exchanged_at = -math.inf
        """When the last exchange was due (changes sent before it are older)."""
        self._believed: dict[tuple[int, EngineKey], InFlight] = {}
        """(replica, engine) -> that replica's work there as the others know it (from the
        last exchange, or a newer change; absent: none)."""
        self._group_blocks = max(1, math.ceil(settings.group_prefix_tokens / p.block_size))
        self._previous: dict[int, str] = {}
        """Follow-up turns not yet arrived (by ``id``) -> the engine of the previous turn."""
        self.seed = seed_for(MODEL)
        fleet = settings.fleet
        roles = (
            [("both", fleet.engines)]
            if fleet.engines
            else [("prefill", fleet.prefill), ("decode", fleet.decode)]
        )
        self.engines: list[_Engine] = []
        order = [role for role, count in roles for _ in range(count)]
        places = settings.layout.place(order) if settings.layout else [None] * len(order)
        slow = _slowed(p, settings.slowdown) if settings.slow_engines else p
        for n, (role, where) in enumerate(zip(order, places, strict=True)):
            key = EngineKey(endpoints[n] if endpoints else f"sim-{role}-{n}:8000")
            own = slow if n < settings.slow_engines else p
            self.engines.append(
                _Engine(
                    key,
                    role,
                    EngineModel(own, hash_seed=n + 1, emit_events=settings.events),
                    StreamState(key, MODEL, p.block_size),
                    where,
                )
            )
        self.prefill_pool = [e for e in self.engines if e.role == "prefill"]
        self.serving_pool = [e for e in self.engines if e.role in ("both", "decode")]
        self._by_key = {e.key: e for e in self.engines}
        for e in self.engines:
            self.pools.add(e.key, e.role, e.topology)
        self._crossing: Counter[str] = Counter()
        """Transfers crossing each rack's uplink now."""
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._flights: dict[tuple[int, str], _Flight] = {}
        self._records: list[RequestRecord] = []
        self._errors: Counter[str] = Counter()
        self._itl = array("d")
        self._sequences: list[tuple[Sequence[int], int, list[int]]] = []
        self._pending: deque[RequestSpec] = deque()
        self._scraped_at = -math.inf
        self._closed_loop = False
        self._slo = settings.policy.latency.slo_for(MODEL)

    def _clock(self) -> float:
        return self.now

    def _replica(self, number: int) -> _Replica:
        """A router replica: the index, load tracker, policies and planner of one
        ``kvroute serve`` (a policy's own state, as cache_aware_sglang's tree, is each
        replica's). With one replica, the plain index of the single router."""
        settings = self.settings
        clock = self._clock
        index = MemoryIndex(clock=clock)
        if settings.replicas > 1:
            # Its decisions' records also go to the other replicas, as the replicated
            # mode publishes them.
            index.on_record = functools.partial(self._share_record, index)
        loads = LoadTracker(
            block_size=self.block_size,
            clock=clock,
            latency=LatencyModel(priors_of(settings.policy)),
            replicas=settings.replicas,
        )
        if settings.replicas > 1 and settings.load_push:
            loads.on_change = functools.partial(self._load_changed, number)
        policy = make_policy(settings.policy, clock)
        core = RoutingCore(
            index,
            policy,
            settings.policy,
            loads,
            has_events=lambda engine: settings.events,
            clock=clock,
        )
        planner = wire_planner(
            self.pools,
            core,
            settings.policy,
            settings.disaggregation,
            lambda model: settings.disaggregation.handoff,
            clock=clock,
            locate=self.pools.topology_of if settings.layout else None,
        )
        return _Replica(number, index, loads, core, planner)

    def _share_record(
        self, origin: MemoryIndex, engine: EngineKey, keys: Sequence[int], ttl: float
    ) -> None:
        """A replica recorded a decision: the others get the same expiring record
        ``sync_delay_s`` later, with what is left of its ttl (none, if it expired on the
        way); at once without a delay."""
        delay = self.settings.sync_delay_s
        if delay <= 0:
            self._apply_record((origin, engine, keys, ttl))
        elif ttl > delay:
            self._push(self.now + delay, _SYNC, (origin, engine, keys, ttl - delay))

    def _apply_record(self, record: tuple[MemoryIndex, EngineKey, Sequence[int], float]) -> None:
        origin, engine, keys, ttl = record
        for replica in self.replicas:
            if replica.index is not origin:
                replica.index.add_now(engine, keys, Tier.GPU, ttl)

    def _load_changed(self, number: int, engine: EngineKey) -> None:
        """Replica ``number``'s own work on ``engine`` changed: the others learn its
        figures ``sync_delay_s`` later (at once without a delay), as
        ``index.redis.load_push`` sends them on the decision stream."""
        load = self.replicas[number].loads.view.get(engine)
        change = (number, engine, self.now, load.own() if load is not None else InFlight())
        delay = self.settings.sync_delay_s
        if delay <= 0:
            self._apply_load(change)
        else:
            self._push(self.now + delay, _LOAD, change)

    def _apply_load(self, change: tuple[int, EngineKey, float, InFlight]) -> None:
        """A replica's figures for one engine reach the others, unless an exchange due
        after they were sent has copied newer ones (changes of one replica arrive in the
        order they were sent: one delay for all)."""
        self._exchange_loads()
        number, engine, sent, figures = change
        if sent < self._exchanged_at:
            return
        believed = self._believed
        believed[number, engine] = figures
        for n, replica in enumerate(self.replicas):
            if n == number:
                continue
            total = InFlight()
            for other in range(len(self.replicas)):
                have = believed.get((other, engine)) if other != n else None
                if have is not None:
                    total = total.plus(have)
            replica.loads.set_peer(engine, total)

    def _exchange_loads(self) -> None:
        """The replicas' exchange of in-flight load, due at every multiple of
        ``load_interval_s``: each replica's peers' part becomes the others' own work.

        Called before anything reads or changes a load tracker (an arrival, a step's
        end), it catches up with the exchanges since the last call: the trackers have not
        changed since then, so the last exchange due would have copied what they hold now.
        """
        now = self.now
        if now < self._next_exchange:
            return
        interval = self.settings.load_interval_s
        self._next_exchange = (math.floor(now / interval) + 1) * interval
        # The trackers hold what they held when it was due: a change sent before now is
        # older than the copy (the due time itself can round above now).
        self._exchanged_at = now
        own = [r.loads.own() for r in self.replicas]
        self._believed = {
            (n, engine): mine for n, work in enumerate(own) for engine, mine in work.items()
        }
        for replica in self.replicas:
            peers: dict[EngineKey, InFlight] = {}
            for other, work in zip(self.replicas, own, strict=True):
                if other is replica:
                    continue
                for engine, mine in work.items():
                    have = peers.get(engine)
                    peers[engine] = mine if have is None else have.plus(mine)
            replica.loads.set_peers(peers)

    def _pick_replica(self, rid: str) -> _Replica:
        """The replica that routes request ``rid``."""
        replicas = self.replicas
        if self.settings.replica_pick == "round_robin":
            turn = self._turn
            self._turn += 1
            return replicas[turn % len(replicas)]
        # Salted: random policies seed their own draws with the bare request id.
        return replicas[xxhash.xxh3_64_intdigest(f"replica\x00{rid}".encode()) % len(replicas)]

    # ------------------------------------------------------------------ running

    async def run(self, specs: Iterable[RequestSpec]) -> SimRun:
        """Replay ``specs``: those with ``at`` arrive then, the others (and follow-up
        turns) in a closed loop of ``concurrency`` sessions."""
        timed: list[RequestSpec] = []
        for spec in specs:
            (timed if spec.at is not None else self._pending).append(spec)
        for spec in timed:
            self._push(float(spec.at or 0.0), _ARRIVE, spec)
        self._closed_loop = bool(self._pending)
        for _ in range(min(self.settings.concurrency, len(self._pending))):
            self._push(0.0, _ARRIVE, self._pending.popleft())
        heap = self._heap
        pop = heapq.heappop
        while heap:
            now, _, kind, item = pop(heap)
            self.now = now
            if kind == _STEP:
                self._step_done(item)
            elif kind == _DELIVER:
                engine, events = item
                await self.ingestor.apply(engine.stream, EventBatch(now, events, None))
            elif kind == _ARRIVE:
                await self._arrive(item)
            elif kind == _SYNC:
                self._apply_record(item)
            elif kind == _LOAD:
                self._apply_load(item)
            elif item.wake_at == now:
                item.wake_at = None
                self._kick(item)
        return self._result()

    def _push(self, at: float, kind: int, item: Any) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), kind, item))

    def _kick(self, engine: _Engine) -> None:
        """Start the engine's next step if it is idle; else remember its next wakeup."""
        if engine.busy:
            return
        now = self.now
        duration = engine.model.start_step(now)
        if duration is not None:
            engine.busy = True
            self._push(now + duration, _STEP, engine)
            return
        wake = engine.model.next_wakeup()
        if wake is not None and (engine.wake_at is None or wake < engine.wake_at):
            engine.wake_at = max(wake, now)
            self._push(engine.wake_at, _WAKE, engine)

    def _scrape(self) -> None:
        """Engine-reported load, as the router's background scrape sees it (every
        replica's scrape reads the same values)."""
        if self.now - self._scraped_at < self.settings.scrape_interval_s:
            return
        self._scraped_at = self.now
        for engine in self.engines:
            stats = engine.model.stats()
            for replica in self.replicas:
                replica.loads.report(
                    engine.key,
                    self.now,
                    waiting=float(stats.num_waiting),
                    running=float(stats.num_running),
                    kv_usage=stats.kv_cache_usage,
                )

    async def _arrive(self, spec: RequestSpec) -> None:
        now = self.now
        previous = self._previous.pop(id(spec), None) if self._previous else None
        if self._closed_loop and spec.at is None:
            limit = self.settings.duration_s
            if limit is not None and now > limit:
                return
        if self._several:
            self._exchange_loads()
        self._scrape()
        tokens = spec_tokens(spec)
        bs = self.block_size
        order = next(self._ids)
        rid = f"sim-{order}"
        router = self._pick_replica(rid) if self._several else self.replicas[0]
        route = RouteRequest(
            rid,
            block_keys(tokens, bs, self.seed),
            len(tokens),
            bs,
            spec.max_tokens,
            session=spec.group or None,
        )
        if self._slo is not None:  # the model's default objectives (policy.latency.slo)
            route.slo_ttft_s = None if self._slo.ttft_ms is None else self._slo.ttft_ms / 1e3
            route.slo_tpot_s = None if self._slo.tpot_ms is None else self._slo.tpot_ms / 1e3
        plan = await router.planner.plan(MODEL, route, len(tokens))
        ticket, prefill_ticket = Charges.of(plan).begin(router.loads)
        serve = self._by_key[plan.decode.engine]
        if plan.prefill is None:
            flight = _Flight(
                rid,
                spec,
                tokens,
                now,
                plan.mode,
                plan.reason,
                serve,
                ticket,
                router,
                order,
                previous,
                keys=route.keys,
            )
            self._submit(serve, flight, EngineRequest(rid, tokens, spec.max_tokens))
            return
        engine = self._by_key[plan.prefill.engine]
        flight = _Flight(
            rid,
            spec,
            tokens,
            now,
            "split",
            plan.reason,
            serve,
            ticket,
            router,
            order,
            previous,
            prefill=engine,
            prefill_ticket=prefill_ticket,
            keys=route.keys,
        )
        self._submit(engine, flight, EngineRequest(rid, tokens, 1, remote_decode=True))

    def _submit(self, engine: _Engine, flight: _Flight, request: EngineRequest) -> None:
        try:
            engine.model.submit(request, self.now)
        except ValueError as exc:
            # The engine refuses it (a prompt longer than its context, as vLLM's 400): the
            # client gets an error, the router releases the request's load.
            self._refuse(flight, str(exc))
            return
        self._flights[(id(engine), flight.rid)] = flight
        self._kick(engine)

    def _refuse(self, flight: _Flight, reason: str) -> None:
        self._transferred(flight)
        loads = flight.router.loads
        loads.end(flight.ticket)
        if flight.prefill_ticket is not None:
            loads.end(flight.prefill_ticket)
        self._errors[reason.split(".")[0]] += 1
        self._next_closed_loop(flight.spec)

    def _step_done(self, engine: _Engine) -> None:
        if self._several and self.now >= self._next_exchange:
            self._exchange_loads()
        engine.busy = False
        now = self.now
        result = engine.model.finish_step(now)
        for out in result.outputs:
            flight = self._flights[(id(engine), out.request_id)]
            if flight.prefill is engine:
                if out.ttft is not None:
                    flight.cached = out.num_cached_tokens
                    engine.prefill_tokens += out.num_prompt_tokens - out.num_cached_tokens
                if out.finished:
                    self._prefill_done(flight, engine)
                continue
            if out.ttft is not None:
                self._first_token(flight, engine, out.num_prompt_tokens, out.num_cached_tokens)
            else:
                self._itl.append(now - flight.last_at)
            flight.last_at = now
            if flight.spec.then is not None:
                flight.output.extend(out.new_token_ids)
            if out.finished:
                self._finish(flight, engine, out.new_token_ids)
        if result.events and self.settings.events:
            self._push(now + self.settings.event_lag_s, _DELIVER, (engine, result.events))
        self._kick(engine)

    def _first_token(self, flight: _Flight, engine: _Engine, prompt: int, cached: int) -> None:
        flight.first_at = self.now
        flight.router.loads.prefilled(flight.ticket)
        if flight.prefill is None:
            flight.cached = cached
            engine.prefill_tokens += prompt - cached
        else:
            # The decode leg has its KV: the prefill engine's hold is read and freed.
            self._transferred(flight)
            prefill = flight.prefill
            prefill.model.release_hold(flight.rid, self.now)
            self._kick(prefill)

    def _prefill_done(self, flight: _Flight, engine: _Engine) -> None:
        """The prefill leg finished: its blocks are held; the decode leg starts."""
        del self._flights[(id(engine), flight.rid)]
        assert flight.prefill_ticket is not None
        loads = flight.router.loads
        loads.prefilled(flight.prefill_ticket)  # its one token: the prefill's time
        loads.end(flight.prefill_ticket)
        engine.model.claim_hold(flight.rid, None, self.now)
        bandwidth, latency = self._link(flight, engine)
        request = EngineRequest(
            flight.rid,
            flight.tokens,
            flight.spec.max_tokens,
            remote_prefill=True,
            transfer_bandwidth=bandwidth,
            transfer_latency_s=latency,
        )
        self._submit(flight.serve, flight, request)

    def _link(self, flight: _Flight, prefill: _Engine) -> tuple[float | None, float]:
        """The decode leg's transfer link: (bytes per second, fixed seconds), by the
        pair's locality and, leaving the rack, the share of both racks' uplinks; (None,
        0) without a layout (the engine's own ``kv_transfer_bandwidth``)."""
        layout = self.settings.layout
        src, dst = prefill.topology, flight.serve.topology
        if layout is None or src is None or dst is None:
            return None, 0.0
        link = link_between(src, dst, self.settings.disaggregation)
        flight.link = link.locality
        bandwidth = link.bandwidth_gb_s * 1e9
        if link.locality not in ("same_node", "same_rack"):
            flight.uplinks = tuple(r for r in (src.rack, dst.rack) if r is not None)
            for rack in flight.uplinks:
                self._crossing[rack] += 1
                bandwidth = min(bandwidth, layout.uplink_gb_s * 1e9 / self._crossing[rack])
        return bandwidth, link.latency_s

    def _transferred(self, flight: _Flight) -> None:
        """The flight's transfer no longer shares its racks' uplinks."""
        for rack in flight.uplinks:
            self._crossing[rack] -= 1
        flight.uplinks = ()

    def _finish(self, flight: _Flight, engine: _Engine, last: list[int]) -> None:
        del self._flights[(id(engine), flight.rid)]
        flight.ticket.output_tokens = flight.spec.max_tokens
        flight.router.loads.end(flight.ticket)
        engine.requests += 1
        now = self.now
        first = flight.first_at if flight.first_at is not None else now
        out_tokens = flight.spec.max_tokens
        self._records.append(
            RequestRecord(
                arrival=flight.arrival,
                prompt_tokens=len(flight.tokens),
                output_tokens=out_tokens,
                cached_tokens=flight.cached,
                engine=engine.key.label,
                prefill_engine=flight.prefill.key.label if flight.prefill else None,
                mode=flight.mode,
                reason=flight.reason,
                ttft=first - flight.arrival,
                e2e=now - flight.arrival,
                group=flight.spec.group,
                link=flight.link,
                replica=flight.router.number,
                order=flight.order,
                prefix_group=self._prefix_group(flight.keys),
                previous_engine=flight.previous,
            )
        )
        spec = flight.spec
        computed: list[int] = []
        if spec.then is not None:
            answer = _words.decode(flight.output)
            generated = answer_tokens(answer)
            if len(generated) > 1:
                computed = block_keys([*flight.tokens, *generated[:-1]], self.block_size, self.seed)
        self._sequences.append((flight.keys, len(flight.tokens), computed))
        if spec.then is not None:
            following = spec.then(answer)
            if following is not None:
                self._previous[id(following)] = engine.key.label
                self._push(now + following.delay, _ARRIVE, following)
                return
        self._next_closed_loop(spec)

    def _prefix_group(self, keys: Sequence[int]) -> int | None:
        """The key of the prompt's first ``group_prefix_tokens`` (its last whole block
        when shorter): block keys are chained, so one key names the whole prefix."""
        return keys[min(self._group_blocks, len(keys)) - 1] if keys else None

    def _next_closed_loop(self, ended: RequestSpec) -> None:
        """A closed-loop slot is free: the next waiting request takes it."""
        if ended.at is None and self._pending:
            self._push(self.now, _ARRIVE, self._pending.popleft())

    def _result(self) -> SimRun:
        order = sorted(range(len(self._records)), key=lambda i: self._records[i].arrival)
        records = [self._records[i] for i in order]
        ceiling = ceiling_of_keys((self._sequences[i] for i in order), self.block_size)
        floor = (
            routing_floor(
                (self._sequences[i] for i in order),
                (r.output_tokens for r in records),
                self._fastest_params(),
            )
            if not self.settings.fleet.disaggregated
            else {}
        )
        engines = []
        preemptions = 0
        for e in self.engines:
            stats = e.model.stats()
            preemptions += stats.num_preemptions
            engines.append(
                {
                    "engine": e.key.label,
                    "role": e.role,
                    "requests": e.requests,
                    "prefill_tokens": e.prefill_tokens,
                    "queried_tokens": stats.prefix_cache_queries,
                    "hit_tokens": stats.prefix_cache_hits,
                    "preemptions": stats.num_preemptions,
                }
            )
        decisions: Counter[str] = Counter()
        for replica in self.replicas:
            for (policy, reason), count in replica.core.counters.decisions.items():
                decisions[f"{policy}:{reason}"] += count
        return SimRun(
            self.name,
            self.settings,
            records,
            self._itl,
            engines,
            ceiling,
            dict(decisions),
            preemptions,
            sum(self.ingestor.counters.skipped.values()),
            floor,
            dict(self._errors),
            **self._router_memory(),
        )

    def _fastest_params(self) -> EngineParams:
        """The engine parameters no engine of the fleet runs faster than (slow engines
        with a factor below 1 are faster)."""
        p, factor = self.settings.params, self.settings.slowdown
        return _slowed(p, factor) if self.settings.slow_engines and factor < 1 else p

    def _router_memory(self) -> dict[str, Any]:
        """The router's index and engine-hash maps as the run leaves them (the first
        replica's, with several: each holds as much)."""
        started = time.perf_counter()
        seen: set[int] = set()
        used = self.index.footprint(seen)
        used += footprint([t for e in self.engines for t in e.stream.hashes], seen)
        return {
            "router_entries": self.index.stats_now().entries,
            "router_expiring": self.index.expiring,
            "router_bytes": used,
            "measure_s": time.perf_counter() - started,
        }
