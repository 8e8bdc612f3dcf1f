"""Real-engine awareness: tokenizer modes, the mismatch guard, model pools and LoRA
adapters (also loaded and unloaded at run time), block-size refusal, batches and DP
ranks, against emulated engines on loopback."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from support.clients import metrics, post, session
from support.engines import TEST_PARAMS, poll, start_test_engine
from support.hf_tokenizer import FIXTURE
from support.routers import start_router

from router.emulator import EmulatedEngine
from router.fleet.registry import EngineState
from router.types import EngineKey

MODEL = "kvroute-emulated"


def endpoint(engine: EmulatedEngine) -> str:
    return f"127.0.0.1:{engine.port}"


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


@pytest_asyncio.fixture(scope="module")
async def evented(ipc_dir: Path) -> AsyncIterator[list[EmulatedEngine]]:
    engines = [
        await start_test_engine(
            engine_id=f"ev{i}",
            kv_events_endpoint=f"ipc://{ipc_dir}/models-ev{i}",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
        )
        for i in range(2)
    ]
    yield engines
    for engine in engines:
        await engine.stop()


async def test_auto_mode_finds_the_emulators_tokenizer(
    evented: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    app = await start_router([e.url for e in evented])
    try:
        assert app.tokenizers.modes() == {MODEL: "words"}
    finally:
        await app.stop()


async def test_engine_mode_keys_match_the_engines_events(
    evented: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    for e in evented:
        await post(http, f"{e.url}/reset_prefix_cache", {})
    app = await start_router([e.url for e in evented], tokenizer={"mode": "engine"})
    try:
        await poll(lambda: app.subscriber and app.subscriber.stats.replays["ok"] == 2)
        prefix = " ".join(f"ctx{i}" for i in range(800))
        first = await post(
            http, f"{app.url}/v1/completions", {"prompt": prefix + " q1", "max_tokens": 1}
        )
        assert first[0] == 200
        await poll(lambda: app.ingestor.counters.blocks_stored >= 50)
        async with http.post(
            f"{app.url}/v1/completions", json={"prompt": prefix + " q2", "max_tokens": 1}
        ) as resp:
            body = await resp.json()
            assert "prefix_hit match=50" in resp.headers["x-kvroute-reason"]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 800
        assert app.tokenizers.modes() == {MODEL: "engine"}
    finally:
        await app.stop()


async def test_a_tokenizer_that_disagrees_with_the_engines_falls_back_to_approximate(
    evented: list[EmulatedEngine],
    http: aiohttp.ClientSession,
    tokenizer_json: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = await start_router(
        [e.url for e in evented],
        tokenizer={"mode": "hf", "path": str(tokenizer_json), "config_path": str(FIXTURE)},
    )
    try:
        assert app.tokenizers.modes() == {MODEL: "hf"}
        with caplog.at_level(logging.WARNING, logger="kvroute.tokenizer"):
            for i in range(12):
                status, _ = await post(
                    http,
                    f"{app.url}/v1/completions",
                    {"prompt": f"the prompt is cached {i}", "max_tokens": 1},
                )
                assert status == 200  # requests never fail because of the tokenizer
        assert app.tokenizers.modes() == {MODEL: "approximate"}
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert any(f"model {MODEL}" in m and "approximate mode" in m for m in errors), errors
        samples = await metrics(http, app.url)
        (mismatch,) = samples["kvroute_tokenizer_mismatches_total"]
        assert mismatch.labels["model"] == MODEL and mismatch.value >= 10
        modes = {s.labels["mode"] for s in samples["kvroute_tokenizer_mode"]}
        assert modes == {"approximate"}
    finally:
        await app.stop()


async def test_approximate_pools_still_keep_shared_prefixes_together(
    evented: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    app = await start_router([e.url for e in evented], tokenizer={"mode": "approximate"})
    try:
        prefix = " ".join(f"shared{i}" for i in range(300))
        engines = set()
        for i in range(6):
            async with http.post(
                f"{app.url}/v1/completions",
                json={"prompt": f"{prefix} question {i}", "max_tokens": 1},
            ) as r:
                assert r.status == 200
                engines.add(r.headers["x-kvroute-engine"])
        assert len(engines) == 1
    finally:
        await app.stop()


@pytest_asyncio.fixture(scope="module")
async def zoo() -> AsyncIterator[dict[str, EmulatedEngine]]:
    """Two models; each with its own adapter on one of its engines."""
    engines = {
        "alpha-0": await start_test_engine(
            engine_id="a0", model="alpha", lora_modules=("alpha-sql",)
        ),
        "alpha-1": await start_test_engine(engine_id="a1", model="alpha"),
        "beta-0": await start_test_engine(
            engine_id="b0", model="beta", lora_modules=("beta-chat",)
        ),
    }
    yield engines
    for engine in engines.values():
        await engine.stop()


async def test_models_and_adapters_route_only_to_engines_that_serve_them(
    zoo: dict[str, EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    app = await start_router([e.url for e in zoo.values()])
    by_endpoint = {endpoint(e): name for name, e in zoo.items()}
    try:
        async with http.get(f"{app.url}/v1/models") as resp:
            served = [m["id"] for m in (await resp.json())["data"]]
        assert served == ["alpha", "alpha-sql", "beta", "beta-chat"]
        expect = {
            "alpha": {"alpha-0", "alpha-1"},
            "alpha-sql": {"alpha-0"},
            "beta": {"beta-0"},
            "beta-chat": {"beta-0"},
        }
        for model, allowed in expect.items():
            seen = set()
            for i in range(6):
                async with http.post(
                    f"{app.url}/v1/completions",
                    json={"model": model, "prompt": f"hi {i}", "max_tokens": 1},
                ) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["model"] == model
                    seen.add(by_endpoint[r.headers["x-kvroute-engine"]])
            assert seen <= allowed, (model, seen)
        status, body = await post(
            http, f"{app.url}/v1/completions", {"model": "gamma", "prompt": "hi"}
        )
        assert status == 404
        assert "alpha, alpha-sql, beta, beta-chat" in body["error"]["message"]
        assert app.registry.base_of("alpha-sql") == "alpha"
    finally:
        await app.stop()


async def test_a_model_is_retrieved_by_its_id_as_the_list_shows_it(
    http: aiohttp.ClientSession,
) -> None:
    """``GET /v1/models/{id}`` (the OpenAI SDK's ``models.retrieve``): a served model or
    adapter is its entry of ``/v1/models``, an id with slashes included; anything else
    OpenAI's 404."""
    engine = await start_test_engine(
        engine_id="org", model="org/base-7b", lora_modules=("org/base-7b-sql",)
    )
    app = await start_router([engine.url])
    try:
        async with http.get(f"{app.url}/v1/models") as resp:
            listed = {m["id"]: m for m in (await resp.json())["data"]}
        assert set(listed) == {"org/base-7b", "org/base-7b-sql"}
        for model, entry in listed.items():
            async with http.get(f"{app.url}/v1/models/{model}") as resp:
                assert resp.status == 200
                assert await resp.json() == entry
        async with http.get(f"{app.url}/v1/models/org%2Fbase-7b") as resp:
            assert resp.status == 200 and (await resp.json())["id"] == "org/base-7b"
        async with http.get(f"{app.url}/v1/models/gamma") as resp:
            assert resp.status == 404
            error = (await resp.json())["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert error["message"] == "The model 'gamma' does not exist"
    finally:
        await app.stop()
        await engine.stop()


async def test_an_adapters_blocks_are_keyed_apart_from_the_base_models(
    zoo: dict[str, EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    engine = zoo["alpha-0"]
    await post(http, f"{engine.url}/reset_prefix_cache", {})
    app = await start_router([engine.url])
    try:
        prompt = " ".join(f"w{i}" for i in range(64))
        for model in ("alpha", "alpha-sql", "alpha-sql"):
            status, body = await post(
                http,
                f"{app.url}/v1/completions",
                {"model": model, "prompt": prompt, "max_tokens": 1},
            )
            assert status == 200
        # the adapter's second request hits its own first one, never the base model's
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    finally:
        await app.stop()


async def test_an_engine_with_another_block_size_is_refused_by_name(
    http: aiohttp.ClientSession,
) -> None:
    good = await start_test_engine(engine_id="bs16")
    odd = await start_test_engine(engine_id="bs32", params=TEST_PARAMS.replace(block_size=32))
    app = await start_router([good.url, odd.url])
    try:
        record = app.registry.get(endpoint(odd))
        assert record is not None and record.state is EngineState.REFUSED
        assert "block size 32" in record.refused_reason and "uses 16" in record.refused_reason
        for i in range(6):
            async with http.post(
                f"{app.url}/v1/completions", json={"prompt": f"x {i}", "max_tokens": 1}
            ) as r:
                assert r.status == 200 and r.headers["x-kvroute-engine"] == endpoint(good)
        samples = await metrics(http, app.url)
        refused = {s.labels["engine"]: s.value for s in samples["kvroute_engine_refused"]}
        assert refused == {endpoint(good): 0.0, endpoint(odd): 1.0}
    finally:
        await app.stop()
        await good.stop()
        await odd.stop()


@pytest.mark.parametrize("n", [1, 3])
async def test_a_batch_is_answered_whole_and_its_usage_counts_every_prompt(
    evented: list[EmulatedEngine], http: aiohttp.ClientSession, n: int
) -> None:
    app = await start_router([e.url for e in evented])
    try:
        prompts = ["short one", " ".join(f"long{i}" for i in range(200)), "mid " * 20]
        status, body = await post(
            http, f"{app.url}/v1/completions", {"prompt": prompts, "max_tokens": 2, "n": n}
        )
        assert status == 200 and len(body["choices"]) == 3 * n
        assert body["usage"]["prompt_tokens"] == 2 + 200 + 20
        assert app.tokenizers.mismatches() == {MODEL: 0}
    finally:
        await app.stop()


@pytest_asyncio.fixture
async def evented_pair(ipc_dir: Path) -> AsyncIterator[list[EmulatedEngine]]:
    engines = [
        await start_test_engine(
            engine_id=f"batch{i}",
            kv_events_endpoint=f"ipc://{ipc_dir}/models-batch{i}",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
        )
        for i in range(2)
    ]
    yield engines
    for engine in engines:
        await engine.stop()


async def test_a_batch_follows_its_longest_prompt_and_counts_every_prompt_in_the_load(
    evented_pair: list[EmulatedEngine], http: aiohttp.ClientSession
) -> None:
    a, b = evented_pair
    app = await start_router([a.url, b.url])
    try:
        await poll(lambda: app.subscriber and app.subscriber.stats.replays["ok"] == 2)
        for n, (short_home, long_home) in enumerate(((a, b), (b, a)), start=1):
            short, long = words(200, f"s{n}-"), words(400, f"l{n}-")
            # Warm the caches directly on the engines: the router learns of it from events.
            for engine, prompt in ((short_home, short), (long_home, long)):
                status, _ = await post(
                    http, f"{engine.url}/v1/completions", {"prompt": prompt, "max_tokens": 1}
                )
                assert status == 200
            await poll(lambda n=n: app.ingestor.counters.blocks_stored >= n * (12 + 24))
            # Hold the batch before the engine so its load can be read while in flight.
            for engine in evented_pair:
                status, _ = await post(
                    http, f"{engine.url}/admin/faults", {"extra_latency_ms": 400}
                )
                assert status == 200
            body = {"prompt": [short, long], "max_tokens": 2, "n": n}
            task = asyncio.ensure_future(post(http, f"{app.url}/v1/completions", body))
            home = EngineKey(endpoint(long_home))
            await poll(
                lambda home=home: (
                    app.core.loads.view.get(home) is not None
                    and app.core.loads.view[home].requests == 1
                )
            )
            load = app.core.loads.view[home]
            # all prompts' tokens, times n, less what the longest prompt finds cached
            assert load.prefill_tokens == (200 + 400) * n - 384, load
            other = app.core.loads.view.get(EngineKey(endpoint(short_home)))
            assert other is None or other.requests == 0
            status, answer = await task
            assert status == 200 and len(answer["choices"]) == 2 * n
            for engine in evented_pair:
                async with http.delete(f"{engine.url}/admin/faults") as resp:
                    assert resp.status == 200
            await poll(lambda: app.core.loads.in_flight == 0)
    finally:
        await app.stop()


class ModelsRelay:
    """Forwards everything to an engine, except GET /v1/models, whose adapters the test
    sets (the emulator's adapters are fixed at start-up)."""

    def __init__(self, target: str, base: str) -> None:
        self.target, self.base = target, base
        self.adapters: list[str] = []
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = session()
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.method == "GET" and request.path == "/v1/models":
            cards = [{"id": self.base, "object": "model", "parent": None}]
            cards += [{"id": n, "object": "model", "parent": self.base} for n in self.adapters]
            return web.json_response({"object": "list", "data": cards})
        assert self._session is not None
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() not in {"host", "content-length", "transfer-encoding", "connection"}
        }
        async with self._session.request(
            request.method,
            self.target + request.path_qs,
            data=await request.read(),
            headers=headers,
        ) as upstream:
            body = await upstream.read()
            return web.Response(
                status=upstream.status,
                body=body,
                content_type=upstream.content_type or "application/json",
            )

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()


async def test_adapters_that_come_and_go_on_an_engine_are_picked_up(
    http: aiohttp.ClientSession,
) -> None:
    engine = await start_test_engine(engine_id="lora-relay", lora_modules=("sql",))
    relay = ModelsRelay(engine.url, MODEL)
    await relay.start()
    app = await start_router([relay.url], health={"models_refresh_s": 0.1})
    try:
        body = {"model": "sql", "prompt": "select star", "max_tokens": 1}

        async def status_is(code: int) -> bool:
            return (await post(http, f"{app.url}/v1/completions", body))[0] == code

        assert await status_is(404)
        relay.adapters = ["sql"]  # the adapter is loaded at run time
        await poll(lambda: status_is(200), timeout=5)
        async with http.get(f"{app.url}/v1/models") as resp:
            served = [m["id"] for m in (await resp.json())["data"]]
        assert "sql" in served
        relay.adapters = []  # ... and unloaded
        await poll(lambda: status_is(404), timeout=5)
    finally:
        await app.stop()
        await relay.stop()
        await engine.stop()


async def test_data_parallel_ranks_are_routing_targets_with_their_own_caches(
    ipc_dir: Path, http: aiohttp.ClientSession
) -> None:
    engine = await start_test_engine(
        engine_id="dp",
        dp_size=2,
        kv_events_endpoint=f"ipc://{ipc_dir}/dp",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
    )
    app = await start_router([engine.url])
    try:
        record = app.registry.get(endpoint(engine))
        assert record is not None and [k.label for k in record.keys] == [
            endpoint(engine),
            f"{endpoint(engine)}#dp1",
        ]
        await poll(lambda: app.subscriber.stats.replays["ok"] == 2)  # one stream per rank
        targets: dict[str, set[str]] = {}
        for group in range(6):
            prefix = " ".join(f"dp{group}w{i}" for i in range(320))
            for q in range(3):
                async with http.post(
                    f"{app.url}/v1/completions", json={"prompt": f"{prefix} q{q}", "max_tokens": 1}
                ) as r:
                    assert r.status == 200
                    body = await r.json()
                    targets.setdefault(f"g{group}", set()).add(r.headers["x-kvroute-engine"])
            # each group's later requests hit the rank that holds its prefix
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 320
        assert all(len(ranks) == 1 for ranks in targets.values()), targets
        assert {next(iter(r)) for r in targets.values()} == {
            endpoint(engine),
            f"{endpoint(engine)}#dp1",
        }
        # both ranks' event streams fed the index, each for its own rank
        await poll(
            lambda: all(
                s.last_seq is not None
                for s in (app.subscriber.stream_state(k) for k in record.keys)
            )
        )
        samples = await metrics(http, engine.url)
        per_rank = {s.labels["engine"]: s.value for s in samples["vllm:prompt_tokens_total"]}
        assert set(per_rank) == {"0", "1"} and all(v > 0 for v in per_rank.values())
    finally:
        await app.stop()
        await engine.stop()
