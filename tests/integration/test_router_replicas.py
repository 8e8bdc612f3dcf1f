"""Two router replicas sharing one Redis in front of four emulated engines.

Routers and engines run in this process; Redis is the session's throw-away server, or
a server of the test's own where the test stops it. Everything is on loopback; every
wait is a poll with a deadline. Tests marked with ``mode`` run in both ways of sharing:
``redis`` (one index in Redis) and ``replicated`` (an index in each replica's memory,
decisions shared through a Redis stream).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml
from prometheus_client.parser import text_string_to_metric_families
from support.clients import post
from support.docs import documented_metrics
from support.engines import poll, start_test_engine
from support.redis import RedisServer
from support.routers import StartRouter

from router.app import RouterApp
from router.emulator import EmulatedEngine
from router.engine_model import EngineParams
from router.events.indexer import Indexer
from router.events.subscriber import EventSource
from router.hashing import block_keys, seed_for
from router.index import Match
from router.index.redis import RedisIndex
from router.index.replicated import decode_decisions, unpack_keys
from router.redis.client import RedisClient
from router.tokenization.words import WordTokenizer
from router.types import EngineKey

MODEL = "kvroute-emulated"
#: Small caches, so that a few prompts evict older ones.
SMALL = EngineParams(num_gpu_blocks=160, max_model_len=2048)


@pytest_asyncio.fixture(scope="module")
async def fleet(ipc_dir: Path) -> AsyncIterator[list[EmulatedEngine]]:
    engines = [
        await start_test_engine(
            engine_id=f"replicas{i}",
            params=SMALL,
            kv_events_endpoint=f"ipc://{ipc_dir}/replicas{i}",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
        )
        for i in range(4)
    ]
    yield engines
    for engine in engines:
        await engine.stop()


@pytest_asyncio.fixture
async def fresh_fleet(
    fleet: list[EmulatedEngine], http: aiohttp.ClientSession
) -> list[EmulatedEngine]:
    for engine in fleet:
        status, _ = await post(http, f"{engine.url}/reset_prefix_cache", {})
        assert status == 200
    return fleet


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A Redis of this test alone, to stop and restart."""
    try:
        server = RedisServer()
    except FileNotFoundError:
        pytest.skip("redis-server is not on the PATH")
    yield server
    server.kill()


def words_tokens(prompt: str) -> list[int]:
    """The emulator's tokens of a completion prompt (the router shares its tokenizer)."""
    return WordTokenizer().encode(prompt)


def key_of(engine: EmulatedEngine) -> EngineKey:
    return EngineKey(f"127.0.0.1:{engine.port}")


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


MODES = ["redis", "replicated"]
"""The two ways replicas share what they know (``index.backend``)."""


def redis_index(
    url: str, namespace: str, budget_ms: float = 1000, mode: str = "redis"
) -> dict[str, Any]:
    # Room for a loaded test machine: the outages here are made (Redis frozen or killed),
    # not timed. Three calls in a row over the budget (shared-load exchanges, every 0.1 s,
    # included) are an outage; at 100 ms a busy machine made outages of its own.
    redis = {"url": url, "namespace": namespace, "budget_ms": budget_ms}
    return {"backend": mode, "redis": redis}


def has_redis(app: RouterApp) -> bool:
    """Whether the replica has Redis (the shared index, or the replicated mode's)."""
    assert app.redis is not None
    return app.redis.available


def subscribed(*apps: RouterApp) -> bool:
    return all(app.subscriber and app.subscriber.stats.replays["ok"] == 4 for app in apps)


async def live_events(http: aiohttp.ClientSession, app: RouterApp, engine: EmulatedEngine) -> None:
    """Wait until the router receives the engine's new batches as they are published (a
    batch published after the initial replay but before the subscription took effect
    shows up only with the next one): each probe, a cache reset, publishes one."""
    assert app.subscriber is not None
    stats = app.subscriber.stats
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while loop.time() < deadline:
        seen = stats.batches
        status, _ = await post(http, f"{engine.url}/reset_prefix_cache", {})
        assert status == 200
        probe_deadline = loop.time() + 0.1
        while loop.time() < probe_deadline:
            if stats.batches > seen:
                return
            await asyncio.sleep(0.005)
    raise AssertionError("the router never received live events")


class HeardEvents:
    """Whether each router has received every KV-event batch the engines published since
    it was made (both subscribe to every engine)."""

    def __init__(self, engines: list[EmulatedEngine], *apps: RouterApp) -> None:
        self.engines = engines
        self.apps = apps
        self.published = self._published()
        self.received = [self._received(app) for app in apps]

    def _published(self) -> int:
        return sum(e.kv_batches_published for e in self.engines)

    @staticmethod
    def _received(app: RouterApp) -> int:
        assert app.subscriber is not None
        return app.subscriber.stats.batches

    def all(self) -> bool:
        since = self._published() - self.published
        return all(
            self._received(app) - before >= since
            for app, before in zip(self.apps, self.received, strict=True)
        )


@dataclass
class Routed:
    status: int
    engine: str
    reason: str
    body: Any


async def ask(
    http: aiohttp.ClientSession, app: RouterApp, body: dict[str, Any], chat: bool = False
) -> Routed:
    return await ask_url(http, app.url, body, chat)


async def ask_url(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], chat: bool = False
) -> Routed:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with http.post(f"{url}{path}", json=body) as resp:
        data = await resp.json() if resp.status == 200 else await resp.text()
        return Routed(
            resp.status,
            resp.headers.get("x-kvroute-engine", ""),
            resp.headers.get("x-kvroute-reason", ""),
            data,
        )


# --------------------------------------------------------------------------- the command


@pytest.mark.parametrize("mode", MODES)
async def test_kvroute_serve_selects_redis_from_the_index_section_of_its_config(
    mode: str,
    fresh_fleet: list[EmulatedEngine],
    http: aiohttp.ClientSession,
    tmp_path: Path,
    redis_url: str,
    redis_namespace: str,
) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "index": {
                    "backend": mode,
                    "redis": {"url": redis_url, "namespace": redis_namespace},
                },
                "engines": [{"url": e.url} for e in fresh_fleet],
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "serve", "--config", str(config), "--port", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        env=env, start_new_session=True,
    )  # fmt: skip
    index = RedisIndex(redis_url, redis_namespace, budget_ms=2000)
    redis = index.redis
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        url = line.rsplit(" ", 1)[-1].strip()
        assert line.startswith("kvroute serve listening on"), line
        prompt = words("served", 320) + " end"
        answer = await ask_url(http, url, {"prompt": prompt, "max_tokens": 1})
        assert answer.status == 200
        keys = block_keys(words_tokens(prompt), 16, seed_for(MODEL))
        engine = EngineKey.parse(answer.engine)
        if mode == "redis":
            # The decision is in Redis, where any replica sees it.
            await poll(lambda: _holds(index, keys, engine))
        else:
            # The decision is on the stream, for every replica to record it.
            await poll(lambda: _streamed(redis, keys, engine))
        replicas = await redis.client.hkeys(f"{{{redis_namespace}}}:load")
        assert len(replicas) == 1  # it shares its load
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert await redis.client.hkeys(f"{{{redis_namespace}}}:load") == []  # withdrawn
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await index.close()


async def _holds(index: RedisIndex, keys: list[int], engine: EngineKey) -> bool:
    return (await index.lookup(keys, [engine])).get(engine) == Match(len(keys))


async def _streamed(redis: RedisClient, keys: list[int], engine: EngineKey) -> bool:
    entries = await redis.client.xrange(redis.key("decisions"))
    return any(
        (endpoint, rank) == (engine.endpoint, engine.rank) and list(unpack_keys(packed)) == keys
        for _, fields in entries
        for endpoint, rank, _, _, packed in decode_decisions(fields[b"d"])
    )


# --------------------------------------------------------------------------- affinity


@pytest.mark.parametrize("mode", MODES)
async def test_a_conversation_alternating_between_replicas_stays_on_one_engine(
    mode: str,
    fresh_fleet: list[EmulatedEngine],
    http: aiohttp.ClientSession,
    routers: StartRouter,
    redis_url: str,
    redis_namespace: str,
) -> None:
    urls = [e.url for e in fresh_fleet]
    # Each replica follows the engines' KV events itself and writes them to Redis (or,
    # replicated, keeps them in its own index).
    # No outage is made here: a budget no busy machine exceeds three calls in a row,
    # or the replicas would route on load alone for a while and the turns would part.
    index = redis_index(redis_url, redis_namespace, budget_ms=5000, mode=mode)
    a = await routers(urls, index=index)
    b = await routers(urls, index=index)
    await poll(lambda: subscribed(a, b), timeout=30)
    for engine in fresh_fleet:  # a busy machine subscribes late: no first turn's events lost
        for app in (a, b):
            await live_events(http, app, engine)
    messages = [
        {"role": "system", "content": words("policy", 300)},
        {"role": "user", "content": "question zero"},
    ]
    turns = []
    heard = HeardEvents(fresh_fleet, a, b)
    for turn in range(6):
        answer = await ask(http, (a, b)[turn % 2], {"messages": messages, "max_tokens": 8}, True)
        assert answer.status == 200, answer.body
        turns.append(answer)
        # The next turn goes to the other replica: it must have the blocks this one
        # stored (on a loaded machine its subscriber can lag the answer by a moment).
        await poll(heard.all, timeout=30)
        messages += [
            {"role": "assistant", "content": answer.body["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"question {turn + 1}"},
        ]
    assert len({t.engine for t in turns}) == 1, [t.engine for t in turns]
    for later in turns[1:]:
        assert "prefix_hit" in later.reason, later.reason
        assert later.body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


# --------------------------------------------------------------------------- indexer


async def test_replicas_fed_by_a_standalone_indexer_see_blocks_stored_and_evicted(
    fresh_fleet: list[EmulatedEngine],
    http: aiohttp.ClientSession,
    routers: StartRouter,
    redis_url: str,
    redis_namespace: str,
) -> None:
    index = RedisIndex(redis_url, redis_namespace, budget_ms=2000)
    sources = [
        EventSource(key_of(e), MODEL, e.kv_events_endpoint, e.kv_events_replay_endpoint, "", 16)
        for e in fresh_fleet
    ]
    indexer = Indexer(index, sources, lease_ms=2000, replay_timeout=1.0, token="test-indexer")
    await indexer.start()
    try:
        urls = [e.url for e in fresh_fleet]
        settings = {
            "index": redis_index(redis_url, redis_namespace),
            "events": {"via_indexer": True},
            "policy": {"provisional_ttl_s": 0.2},
        }
        a = await routers(urls, **settings)
        b = await routers(urls, **settings)
        fleet_keys = [key_of(e) for e in fresh_fleet]
        assert a.subscriber is None and b.subscriber is None
        # Decisions are provisional (the indexer's events will confirm them), not
        # approximate-mode records that would outlive what the engines hold.
        assert all(a.core.has_events(k) for k in fleet_keys)

        def keys_of(prompt: str) -> list[int]:
            return block_keys(words_tokens(prompt), 16, seed_for(MODEL))

        async def seen(keys: list[int]) -> list[dict[EngineKey, Match]]:
            return [dict(await app.index.lookup(keys, fleet_keys)) for app in (a, b)]

        stored = words("stored", 640) + " end"  # 40 full blocks
        sent = time.monotonic()
        answer = await ask(http, a, {"prompt": stored, "max_tokens": 1})
        assert answer.status == 200
        holder = EngineKey.parse(answer.engine)
        expected = {holder: Match(40)}

        async def stored_on_both() -> bool:
            # Past the decision's provisional TTL only the indexer's entries are left.
            return time.monotonic() - sent > 0.5 and await seen(keys_of(stored)) == [expected] * 2

        await poll(stored_on_both, timeout=10)
        # Evictions: fill the holder's 160-block cache with two 100-block prompts, sent
        # to it directly so that no router records anything.
        engine = next(e for e in fresh_fleet if key_of(e) == holder)
        fillers = [words(f"filler{i}-", 1600) + " end" for i in range(2)]
        for filler in fillers:
            status, _ = await post(
                http, f"{engine.url}/v1/completions", {"prompt": filler, "max_tokens": 1}
            )
            assert status == 200

        async def evicted_on_both() -> bool:
            return await seen(keys_of(stored)) == [{}, {}]

        await poll(evicted_on_both, timeout=10)
        assert (await seen(keys_of(fillers[1])))[1] == {holder: Match(100)}
        status, _ = await post(http, f"{engine.url}/reset_prefix_cache", {})
        assert status == 200

        async def cleared_on_both() -> bool:
            return await seen(keys_of(fillers[1])) == [{}, {}]

        await poll(cleared_on_both, timeout=10)
    finally:
        await indexer.stop()
        await index.close()


# --------------------------------------------------------------------------- shared load


@pytest.mark.parametrize("mode", MODES)
async def test_a_replica_avoids_the_engines_another_replica_loaded(
    mode: str,
    http: aiohttp.ClientSession,
    routers: StartRouter,
    redis_url: str,
    redis_namespace: str,
) -> None:
    # Real-time engines: a long answer keeps its request in flight for seconds.
    engines = [
        await start_test_engine(engine_id=f"slow{i}", params=SMALL, time_scale=1.0)
        for i in range(4)
    ]
    streams: list[aiohttp.ClientResponse] = []
    try:
        urls = [e.url for e in engines]
        settings = {
            "index": redis_index(redis_url, redis_namespace, mode=mode),
            "events": {"enabled": False},
        }
        a = await routers(urls, **settings)
        b = await routers(urls, **settings)
        loaded = set()
        for i in range(3):
            body = {"prompt": words(f"long{i}-", 64), "max_tokens": 1500, "stream": True}
            resp = await http.post(f"{a.url}/v1/completions", json=body)
            assert resp.status == 200
            await resp.content.readany()  # the first token: the request is decoding
            streams.append(resp)
            loaded.add(resp.headers["x-kvroute-engine"])
        assert len(loaded) == 3  # A spread its own work

        def peer_requests() -> int:
            return sum(load.peer_requests for load in b.loads.view.values())

        await poll(lambda: peer_requests() == 3)
        (idle,) = {key_of(e).label for e in engines} - loaded
        for i in range(4):
            answer = await ask(http, b, {"prompt": words(f"short{i}-", 64), "max_tokens": 1})
            assert answer.status == 200
            assert answer.engine == idle, answer.reason
        async with http.get(f"{b.url}/metrics") as resp:
            families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
        exposed = {name for name in families if name.startswith("kvroute_")}
        assert exposed <= documented_metrics(), exposed - documented_metrics()
        peers = families["kvroute_engine_peer_inflight_requests"].samples
        assert sorted(s.labels["engine"] for s in peers if s.value == 1) == sorted(loaded)
        assert families["kvroute_load_peers"].samples[0].value == 1
        for resp in streams:
            resp.close()
        await poll(lambda: peer_requests() == 0)
    finally:
        for resp in streams:
            resp.close()
        for engine in engines:
            await engine.stop()


# --------------------------------------------------------------------------- outages


async def test_event_writes_redis_refused_are_made_good_once_it_accepts_them(
    fresh_fleet: list[EmulatedEngine],
    http: aiohttp.ClientSession,
    routers: StartRouter,
    own_server: RedisServer,
) -> None:
    app = await routers([e.url for e in fresh_fleet], index=redis_index(own_server.url, "refusing"))
    app.events.resync_retry_s = 0.2
    await poll(lambda: subscribed(app))
    engine = fresh_fleet[0]
    await live_events(http, app, engine)
    admin = RedisIndex(own_server.url, "refusing", budget_ms=2000)
    try:
        # Reachable, but refusing writes (NOREPLICAS, here; out of memory in the wild):
        # no outage is announced.
        await admin.redis.client.config_set("min-replicas-to-write", 1)
        prompt = words("refused", 320) + " end"
        failures = app.event_writer.stats.failures
        status, _ = await post(
            http, f"{engine.url}/v1/completions", {"prompt": prompt, "max_tokens": 1}
        )
        assert status == 200
        await poll(lambda: app.event_writer.stats.failures > failures)
        assert app.redis.available
        await admin.redis.client.config_set("min-replicas-to-write", 0)
        keys = block_keys(words_tokens(prompt), 16, seed_for(MODEL))
        await poll(lambda: _holds(admin, keys, key_of(engine)), timeout=10)
        assert app.event_writer.stats.resnapshots >= 1
    finally:
        await admin.redis.client.config_set("min-replicas-to-write", 0)
        await admin.close()


@dataclass
class Probe:
    """Turn 1 of a fresh conversation through one replica, turn 2 through the other."""

    started: float
    failed: int
    affine: bool
    """Turn 2 went where turn 1 did, on the shared index's word (a prefix hit)."""


class Flow:
    """Probes started at a steady rate, whatever their latency."""

    def __init__(self, http: aiohttp.ClientSession, first: RouterApp, second: RouterApp) -> None:
        self.http = http
        self.first, self.second = first, second
        self.probes: list[Probe] = []
        self.sent = 0
        self._stop = asyncio.Event()

    async def run(self, interval: float) -> None:
        loop = asyncio.get_running_loop()
        tasks = []
        count = 0
        next_at = loop.time()
        while not self._stop.is_set():
            tasks.append(asyncio.ensure_future(self._probe(count)))
            count += 1
            next_at += interval
            await asyncio.sleep(max(next_at - loop.time(), 0.0))
        await asyncio.gather(*tasks)

    def stop(self) -> None:
        self._stop.set()

    async def _probe(self, n: int) -> None:
        started = time.monotonic()
        prompt = words(f"probe{n}-", 320)
        failed = 0
        routed = []
        for app, text in ((self.first, prompt), (self.second, prompt + " and then some")):
            self.sent += 1
            try:
                answer = await ask(self.http, app, {"prompt": text, "max_tokens": 2})
            except aiohttp.ClientError:
                failed += 1
                continue
            if answer.status != 200:
                failed += 1
            routed.append(answer)
        affine = (
            len(routed) == 2
            and routed[0].engine == routed[1].engine
            and "prefix_hit" in routed[1].reason
        )
        self.probes.append(Probe(started, failed, affine))

    @property
    def failed(self) -> int:
        return sum(p.failed for p in self.probes)

    def recovered_at(self, after: float, streak: int) -> float | None:
        """Start of the first probe after ``after`` that begins ``streak`` finished probes
        in a row keeping affinity. (Not "every probe from then on": on a loaded machine a
        turn 2 now and then outruns the record of its turn 1 on the other replica, which
        says nothing about an outage being over.)"""
        later = sorted((p for p in self.probes if p.started >= after), key=lambda p: p.started)
        for i in range(len(later) - streak + 1):
            if all(p.affine for p in later[i : i + streak]):
                return later[i].started
        return None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("outage", ["frozen", "restarted"])
async def test_a_redis_outage_fails_no_request_and_affinity_returns_after_it(
    outage: str,
    mode: str,
    fresh_fleet: list[EmulatedEngine],
    http: aiohttp.ClientSession,
    routers: StartRouter,
    own_server: RedisServer,
) -> None:
    urls = [e.url for e in fresh_fleet]
    a = await routers(urls, index=redis_index(own_server.url, "outage", mode=mode))
    b = await routers(urls, index=redis_index(own_server.url, "outage", mode=mode))
    await poll(lambda: subscribed(a, b))
    flow = Flow(http, a, b)
    running = asyncio.ensure_future(flow.run(interval=0.02))
    replacement = None
    try:
        await poll(lambda: flow.recovered_at(0.0, streak=3) is not None, timeout=30)
        if outage == "frozen":
            own_server.pause()
        else:
            own_server.kill()
        stopped = time.monotonic()
        # A deadline, not a measurement: three calls in a row over the 1 s budget each
        # (seconds more when the machine is loaded and the probes' calls queue).
        await poll(lambda: not (has_redis(a) or has_redis(b)), timeout=20)
        # Keep it down for a while, with requests flowing through both replicas.
        await poll(
            lambda: (
                time.monotonic() - stopped > 1.5
                and sum(p.started > stopped for p in flow.probes) >= 10
            ),
            timeout=10,
        )
        back = time.monotonic()  # from before the restart: its start-up time counts too
        if outage == "frozen":
            own_server.resume()
        else:  # an empty Redis on the same port, as after a restart without persistence
            # Started from a thread: the routers keep running (and probing) meanwhile.
            replacement = await asyncio.to_thread(RedisServer, port=own_server.port)
        await poll(lambda: has_redis(a) and has_redis(b), timeout=10)
        available = time.monotonic() - back
        # A deadline, not a measurement: affinity comes back once the replicas have
        # rewritten the index from their engines' events (about a second here when the
        # machine is idle, several when it is loaded); the print says how long it took.
        await poll(lambda: flow.recovered_at(back, streak=5) is not None, timeout=30)
        if mode == "replicated":
            # Decisions flow between the replicas again once Redis is back.
            sync_a, sync_b = a.replicated.sync, b.replicated.sync
            published, applied = sync_a.counters.published, sync_b.counters.applied
            probe = await ask(http, a, {"prompt": words("after-outage", 320), "max_tokens": 1})
            assert probe.status == 200
            await poll(lambda: sync_a.counters.published > published)
            await poll(lambda: sync_b.counters.applied > applied)
    finally:
        flow.stop()
        await running
        if replacement is not None:
            replacement.kill()
    recovered = flow.recovered_at(back, streak=5)
    assert recovered is not None
    during = [p for p in flow.probes if stopped < p.started < back]
    print(
        f"\n{outage}: {flow.sent} requests, {flow.failed} failed; "
        f"{sum(p.affine for p in during)}/{len(during)} probes affine during the outage; "
        f"both replicas on Redis {available:.2f} s and affinity back "
        f"{recovered - back:.2f} s after it returned"
    )
    assert flow.failed == 0
    if mode == "replicated":
        # Lookups never need Redis: the engines' KV events, which every replica follows
        # itself, kept conversations on their engine during the outage too.
        assert any(p.affine for p in during), f"0/{len(during)} probes affine"
    for app in (a, b):
        assert app.redis is not None and app.redis.counters.outages >= 1
        if mode == "redis":
            assert app.shadowed.counters.fallbacks > 0
            if outage == "restarted":
                # Redis came back empty: every engine stream was rewritten from its events.
                assert app.event_writer.stats.resnapshots >= 4


async def test_a_lookup_over_the_budget_says_so_in_the_reason_and_the_access_log(
    fresh_fleet: list[EmulatedEngine],
    routers: StartRouter,
    own_server: RedisServer,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Over budget by construction, not by chance: a frozen Redis never answers, while a
    # live one answers a lookup well within 2 s even on a loaded machine (at 100 ms a
    # loaded machine can put the lookup that must be answered over budget too).
    index = redis_index(own_server.url, "budget", budget_ms=2000)
    index["redis"] |= {
        "slow_calls_to_outage": 1_000,  # every call over budget, none an outage
        "share_load": False,
    }
    app = await routers([e.url for e in fresh_fleet[:2]], index=index, server={"access_log": True})
    body = {"prompt": words("budget", 64), "max_tokens": 1}
    answered = await ask(http, app, body)
    assert answered.status == 200
    assert "index=" not in answered.reason  # Redis answered
    own_server.pause()
    try:
        with caplog.at_level(logging.INFO, "kvroute.access"):
            routed = await ask(http, app, {**body, "prompt": words("frozen", 64)})
        assert routed.status == 200
        assert "latency:no_prefix match=0 index=shadow:over_budget" in routed.reason
        assert "index=shadow:over_budget" in caplog.text  # the access log's reason
    finally:
        own_server.resume()
