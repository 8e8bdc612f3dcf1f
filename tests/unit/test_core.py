"""The routing core: provisional holders, approximate mode, and load spreading."""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Mapping, Sequence

from router.config import PolicyConfig
from router.core import RoutingCore
from router.fleet.load import LoadTracker
from router.hashing import block_keys, seed_for
from router.index import Match, MemoryIndex
from router.index.base import IndexUnavailable
from router.policy import make_policy
from router.policy.base import RouteRequest
from router.types import EngineKey

ENGINES = [EngineKey(f"127.0.0.1:{9000 + i}") for i in range(8)]
SEED = seed_for("model")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_core(clock: Clock, **policy) -> RoutingCore:
    cfg = PolicyConfig(**policy)
    return RoutingCore(
        MemoryIndex(clock=clock), make_policy(cfg, clock), cfg, LoadTracker(16), clock=clock
    )


def prompt(shared: list[int], unique: int, rng: random.Random) -> list[int]:
    return shared + [rng.randrange(1024, 100_000) for _ in range(unique)]


async def test_a_burst_follows_the_first_choice_until_that_engine_saturates() -> None:
    clock = Clock()
    core = make_core(clock, name="kv_cost")
    rng = random.Random(1)
    shared = [rng.randrange(1024, 100_000) for _ in range(2000)]
    chosen = []
    for i in range(40):
        tokens = prompt(shared, 96, rng)
        request = RouteRequest(f"burst-{i}", block_keys(tokens, 16, SEED), len(tokens), 16, 64)
        decision = await core.route(request, ENGINES)
        core.loads.begin(decision.engine, len(tokens), decision.cached_tokens, 64)
        chosen.append(decision.engine)
    first = chosen[0]
    # No KV event has arrived yet: the provisional record alone keeps the group together...
    assert chosen[:10] == [first] * 10
    # ...until the queue on that engine costs more than recomputing the prefix elsewhere.
    assert len(set(chosen)) >= 2
    # The spill-over follows a second holder instead of scattering over every engine.
    assert len(set(chosen)) <= 4


async def test_provisional_holders_expire_without_confirmation() -> None:
    clock = Clock()
    core = make_core(clock, provisional_ttl_s=2.0)
    keys = block_keys(list(range(1024, 1024 + 640)), 16, SEED)
    d1 = await core.route(RouteRequest("a", keys, 640, 16), ENGINES)
    assert list(await core.index.lookup(keys, ENGINES)) == [d1.engine]
    clock.now += 2.5
    assert await core.index.lookup(keys, ENGINES) == {}


async def test_engines_without_events_are_tracked_for_the_approximate_ttl() -> None:
    clock = Clock()
    cfg = PolicyConfig(provisional_ttl_s=2.0, approximate_ttl_s=120.0)
    core = RoutingCore(
        MemoryIndex(clock=clock),
        make_policy(cfg, clock),
        cfg,
        LoadTracker(16),
        has_events=lambda engine: False,
        clock=clock,
    )
    keys = block_keys(list(range(1024, 1024 + 640)), 16, SEED)
    d1 = await core.route(RouteRequest("a", keys, 640, 16), ENGINES)
    clock.now += 60
    d2 = await core.route(RouteRequest("b", keys, 640, 16), ENGINES)
    assert d2.engine == d1.engine and d2.reason == "prefix_hit"


async def test_baselines_do_not_touch_the_index() -> None:
    clock = Clock()
    core = make_core(clock, name="round_robin")
    keys = block_keys(list(range(1024, 1024 + 640)), 16, SEED)
    await core.route(RouteRequest("a", keys, 640, 16), ENGINES)
    assert (await core.index.stats()).entries == 0


async def test_a_shared_first_block_does_not_pile_onto_one_engine() -> None:
    """Every prompt shares its first 512 tokens (as in the Mooncake conversation trace)
    and then diverges; with completions simulated on a virtual clock, assignments stay
    within 1.3x of the mean on every engine."""
    clock = Clock()
    core = make_core(clock)
    rng = random.Random(7)
    shared = [rng.randrange(1024, 100_000) for _ in range(512)]
    prefill_rate = 10_000.0  # tokens per second per engine
    busy_until = dict.fromkeys(ENGINES, 0.0)
    pending: list[tuple[float, int, str, object]] = []
    seq = 0
    assigned: Counter[EngineKey] = Counter()
    for i in range(3000):
        clock.now += rng.expovariate(14.0)  # about 70% of the fleet's prefill capacity
        while pending and pending[0][0] <= clock.now:
            _, _, kind, payload = heapq.heappop(pending)
            if kind == "prefilled":
                ticket, keys = payload  # type: ignore[misc]
                core.loads.prefilled(ticket)
                await core.index.add(ticket.engine, keys)  # the engine's BlockStored
            else:
                core.loads.end(payload)  # type: ignore[arg-type]
        tokens = prompt(shared, rng.randrange(1000, 6000), rng)
        keys = block_keys(tokens, 16, SEED)
        decision = await core.route(RouteRequest(f"m{i}", keys, len(tokens), 16, 300), ENGINES)
        engine = decision.engine
        assigned[engine] += 1
        ticket = core.loads.begin(engine, len(tokens), decision.cached_tokens, 300)
        start = max(clock.now, busy_until[engine])
        done = start + (len(tokens) - decision.cached_tokens) / prefill_rate
        busy_until[engine] = done
        for when, kind, payload in (
            (done, "prefilled", (ticket, keys)),
            (done + 2.0, "end", ticket),
        ):
            seq += 1
            heapq.heappush(pending, (when, seq, kind, payload))
    mean = sum(assigned.values()) / len(ENGINES)
    assert len(assigned) == len(ENGINES)
    assert max(assigned.values()) / mean <= 1.3, assigned


class _UnreachableIndex(MemoryIndex):
    async def lookup(
        self, keys: Sequence[int], candidates: Sequence[EngineKey]
    ) -> Mapping[EngineKey, Match]:
        raise IndexUnavailable("Redis is unreachable: refused", "unreachable")


async def test_a_decision_without_the_index_says_so_in_its_reason() -> None:
    clock = Clock()
    cfg = PolicyConfig()
    core = RoutingCore(
        _UnreachableIndex(clock=clock), make_policy(cfg, clock), cfg, LoadTracker(16), clock=clock
    )
    request = RouteRequest("r", block_keys(list(range(64)), 16, SEED), 64, 16)
    decision = await core.route(request, ENGINES[:2])
    assert decision.reason == "no_prefix" and decision.index == "skipped:unreachable"
    assert "index=skipped:unreachable" in decision.summary()
    assert core.counters.index_errors == 1
    answered = await make_core(clock).route(request, ENGINES[:2])
    assert answered.index == "" and "index=" not in answered.summary()
