"""The shared-index interface with a backend that is not Redis: the router's shadow, the
event writer and a router's wiring work through ``RemoteIndex`` alone.

The backend is defined here: the memory index behind an availability switch, so that
outages, slow answers and data loss are set by the test instead of by a Redis server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence

import pytest
from prometheus_client import generate_latest

from router.app import RouterApp
from router.config import load_config
from router.events.ingest import StreamState
from router.events.types import BlockStored, EventBatch
from router.events.writer import RemoteEventWriter
from router.hashing import block_keys, seed_for
from router.index import IndexStats, Match, MemoryIndex
from router.index.base import FallbackMatches, IndexUnavailable
from router.index.remote import (
    AddOp,
    AvailabilityListener,
    ClearOp,
    ExpireOp,
    RemoteCounters,
    RemoteIndex,
    RemoveOp,
    WriteBatch,
    WriteResult,
)
from router.index.shadow import ShadowedIndex
from router.types import EngineKey, Tier

A, B = EngineKey("10.0.0.1:8000"), EngineKey("10.0.0.2:8000")
FLEET = [A, B]


class SwitchedRemote(RemoteIndex):
    """A remote backend in this process: a MemoryIndex that can be switched off."""

    def __init__(self) -> None:
        self.data = MemoryIndex()
        self.listeners: list[AvailabilityListener] = []
        self.counters = RemoteCounters()
        self.up = True
        self.refuse_next: str | None = None
        """Make the next lookup fail with this ``why`` (``over_budget``: a slow answer)
        without marking the backend down."""
        self.writes: list[WriteBatch] = []

    @property
    def available(self) -> bool:
        return self.up

    def go_down(self) -> None:
        self.up = False
        self.counters.outages += 1
        for listener in list(self.listeners):
            listener(False, False)

    def come_back(self, data_lost: bool = False) -> None:
        if data_lost:
            self.data = MemoryIndex()
        self.up = True
        for listener in list(self.listeners):
            listener(True, data_lost)

    def _check(self) -> None:
        self.counters.calls += 1
        if not self.up:
            self.counters.fast_failures += 1
            raise IndexUnavailable("switched off", "unreachable")

    async def lookup(
        self, keys: Sequence[int], candidates: Sequence[EngineKey]
    ) -> Mapping[EngineKey, Match]:
        self._check()
        if self.refuse_next is not None:
            why, self.refuse_next = self.refuse_next, None
            raise IndexUnavailable("refused by the test", why)
        return await self.data.lookup(keys, candidates)

    async def add(
        self,
        engine: EngineKey,
        keys: Sequence[int],
        tier: Tier = Tier.GPU,
        ttl: float | None = None,
    ) -> None:
        self._check()
        await self.data.add(engine, keys, tier, ttl)

    async def remove(
        self, engine: EngineKey, keys: Sequence[int], tier: Tier | None = None
    ) -> None:
        self._check()
        await self.data.remove(engine, keys, tier)

    async def clear(self, engine: EngineKey) -> None:
        self._check()
        await self.data.clear(engine)

    async def stats(self) -> IndexStats:
        self._check()
        return await self.data.stats()

    async def write(
        self, batches: Sequence[WriteBatch], timeout: float | None = None
    ) -> list[WriteResult]:
        self._check()
        for batch in batches:
            if batch.fence is not None:
                raise ValueError("this backend takes no fenced writes")
            self.writes.append(batch)
            for op in batch.ops:
                if isinstance(op, AddOp):
                    await self.data.add(batch.engine, op.keys, op.tier)
                elif isinstance(op, ExpireOp):
                    await self.data.add(batch.engine, op.keys, ttl=op.ttl)
                elif isinstance(op, RemoveOp):
                    await self.data.remove(batch.engine, op.keys, op.tier)
                elif isinstance(op, ClearOp):
                    await self.data.clear(batch.engine)
        return [WriteResult.APPLIED] * len(batches)


async def until(check: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        done = check()
        if asyncio.iscoroutine(done):
            done = await done
        if done:
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.01)


@pytest.fixture
def remote() -> SwitchedRemote:
    return SwitchedRemote()


@pytest.fixture
async def shadowed(remote: SwitchedRemote):
    index = ShadowedIndex(remote)
    yield index
    await index.close()


KEYS = list(range(500, 540))


async def remote_holds(remote: SwitchedRemote, keys: list[int], engine: EngineKey) -> int:
    """Depth the backend itself (not the shadow) reports for ``engine``."""
    match = (await remote.data.lookup(keys, FLEET)).get(engine)
    return 0 if match is None else match.blocks


async def test_decision_records_reach_the_remote_backend_off_the_request_path(
    shadowed: ShadowedIndex, remote: SwitchedRemote
) -> None:
    await shadowed.add(A, KEYS, ttl=30)
    await shadowed.drain()
    assert await remote_holds(remote, KEYS, A) == 40
    ((op,),) = [batch.ops for batch in remote.writes]
    assert isinstance(op, ExpireOp) and op.keys == KEYS and 29 < op.ttl <= 30
    answer = await shadowed.lookup(KEYS, FLEET)
    assert answer == {A: Match(40)} and not isinstance(answer, FallbackMatches)


async def test_firm_records_removals_and_clears_go_straight_to_the_remote_backend(
    shadowed: ShadowedIndex, remote: SwitchedRemote
) -> None:
    await shadowed.add(B, KEYS)
    assert await remote_holds(remote, KEYS, B) == 40
    await shadowed.remove(B, KEYS[20:])
    assert await remote_holds(remote, KEYS, B) == 20
    await shadowed.clear(B)
    assert await remote_holds(remote, KEYS, B) == 0
    assert (await shadowed.stats()).blocks == 0


async def test_while_the_remote_backend_is_down_lookups_come_from_the_shadow(
    shadowed: ShadowedIndex, remote: SwitchedRemote
) -> None:
    await shadowed.add(A, KEYS, ttl=30)
    await shadowed.drain()
    remote.go_down()
    assert not shadowed.available
    calls = remote.counters.calls
    answer = await shadowed.lookup(KEYS, FLEET)
    assert isinstance(answer, FallbackMatches) and answer.note == "shadow:unavailable"
    assert answer == {A: Match(40)}
    assert remote.counters.calls == calls  # a backend marked down is not even asked
    assert shadowed.counters.fallbacks == 1
    # A decision made meanwhile is remembered by the shadow and left for the replay.
    await shadowed.add(B, KEYS[:16], ttl=30)
    assert shadowed.counters.unwritten == 1
    assert await shadowed.lookup(KEYS[:16], [B]) == {B: Match(16)}


async def test_a_remote_answer_over_budget_falls_back_for_that_lookup_alone(
    shadowed: ShadowedIndex, remote: SwitchedRemote
) -> None:
    await shadowed.add(A, KEYS, ttl=30)
    await shadowed.drain()
    remote.refuse_next = "over_budget"
    late = await shadowed.lookup(KEYS, FLEET)
    assert isinstance(late, FallbackMatches) and late.note == "shadow:over_budget"
    assert late == {A: Match(40)}
    assert shadowed.counters.errors == 1
    again = await shadowed.lookup(KEYS, FLEET)
    assert not isinstance(again, FallbackMatches) and again == {A: Match(40)}


async def test_a_remote_backend_that_lost_its_data_gets_the_live_decisions_back(
    shadowed: ShadowedIndex, remote: SwitchedRemote
) -> None:
    await shadowed.add(A, KEYS, ttl=30)
    await shadowed.drain()
    remote.go_down()
    await shadowed.add(B, list(range(900, 932)), ttl=30)  # never reached the backend
    remote.come_back(data_lost=True)
    assert await remote_holds(remote, KEYS, A) == 0  # nothing left before the replay
    await until(lambda: shadowed.counters.replayed == 2)
    assert await remote_holds(remote, KEYS, A) == 40
    assert await remote_holds(remote, list(range(900, 932)), B) == 32


async def test_a_remote_backend_that_kept_its_data_gets_only_what_it_missed(
    shadowed: ShadowedIndex, remote: SwitchedRemote
) -> None:
    await shadowed.add(A, KEYS, ttl=30)
    await shadowed.drain()
    remote.go_down()
    missed = list(range(900, 932))
    await shadowed.add(B, missed, ttl=30)
    remote.come_back()
    await until(lambda: shadowed.counters.replayed == 1)
    assert await remote_holds(remote, missed, B) == 32


async def test_the_event_writer_writes_kv_event_batches_to_any_remote_backend(
    remote: SwitchedRemote,
) -> None:
    writer = RemoteEventWriter(remote)
    model, size = "m", 4
    tokens = list(range(12))
    state = StreamState(A, model, size)
    stored = BlockStored([11, 12, 13], None, tokens, size)
    await writer.apply(state, EventBatch(1.0, [stored]))
    await writer.drain()
    await writer.close()
    keys = block_keys(tokens, size, seed_for(model))
    assert await remote.data.lookup(keys, FLEET) == {A: Match(3)}
    assert writer.stats.batches == 1 and len(remote.writes) == 1


async def test_the_event_writer_bounds_its_map_and_removes_what_it_forgets(
    remote: SwitchedRemote,
) -> None:
    """``index.max_entries_per_engine`` with a shared index: the writer's engine-hash map
    keeps at most that many hashes per tier, and the blocks of those it forgets are
    removed from the shared index in the same write, so a runaway engine grows neither
    the router nor the backend past the cap."""
    writer = RemoteEventWriter(remote, max_blocks_per_engine=40)
    state = StreamState(A, "m", 4)
    for start in range(0, 400, 10):
        tokens = list(range(start * 4, (start + 10) * 4))
        await writer.apply(
            state,
            EventBatch(1.0, [BlockStored(list(range(start + 1, start + 11)), None, tokens, 4)]),
        )
    await writer.drain()
    await writer.close()
    assert len(state.hashes[Tier.GPU]) <= 40
    assert writer.counters.forgotten_hashes == 400 - len(state.hashes[Tier.GPU])
    held = (await remote.data.held_blocks())[A]
    assert held == len(state.hashes[Tier.GPU])
    newest = block_keys(list(range(390 * 4, 400 * 4)), 4, seed_for("m"))
    assert await remote.data.lookup(newest, FLEET) == {A: Match(10)}


def test_fenced_event_writes_need_a_backend_with_leases(remote: SwitchedRemote) -> None:
    with pytest.raises(TypeError, match="FencedIndex"):
        RemoteEventWriter(remote, token="indexer-1")


async def test_a_router_wires_any_remote_backend_through_the_shadow(
    remote: SwitchedRemote,
) -> None:
    config = load_config(overrides={"engines": [{"url": "http://10.0.0.1:8000"}]}, environ={})
    index = ShadowedIndex(remote)
    app = RouterApp(config, index=index)
    try:
        assert app.shadowed is index and app.remote is remote and app.redis is None
        assert isinstance(app.event_writer, RemoteEventWriter)
        assert app.event_writer.remote is remote
        scrape = generate_latest(app.metrics.registry).decode()
        assert "kvroute_index_available 1.0" in scrape
        remote.go_down()
        scrape = generate_latest(app.metrics.registry).decode()
        assert "kvroute_index_available 0.0" in scrape
        assert "kvroute_index_outages_total 1.0" in scrape
    finally:
        await app.index.close()
