"""``tokenizer.mode: auto`` finds the served model's own tokenizer without being told, in
order: a directory the engine reports (vLLM's ``root``, SGLang's ``tokenizer_path``),
``tokenizer.model_dirs``, the Hugging Face cache, the emulator's words, the hub (in the
background), else approximate keys whose characters per token are measured against the
engines' usage; never a round trip to an engine per request.

The engine is an object here that answers ``/v1/models`` and ``/tokenize`` as vLLM does,
tokenizing with its model's files: what is under test is the choice, not HTTP (the
integration and real-vLLM tiers test the wiring). The hub is a real HTTP server on
loopback (``HF_ENDPOINT``), and the Hugging Face cache a temporary directory
(``HF_HUB_CACHE``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import huggingface_hub.constants
import msgspec
import pytest
import pytest_asyncio
from aiohttp import web
from support.engines import poll
from support.hf_tokenizer import FIXTURE, train_tiny_tokenizer
from support.tiny_model import make_tiny_llama

from router.config import load_config
from router.tokenization.base import TokenizeError
from router.tokenization.modes import HFTokenizer
from router.tokenization.pools import CALIBRATION_ANSWERS, Tokenizers
from router.tokenization.words import WordTokenizer

MODEL = "tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The served model's directory: its tokenizer.json and tokenizer_config.json."""
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another model's tokenizer files (another vocabulary, the same chat template)."""
    directory = tmp_path_factory.mktemp("other")
    train_tiny_tokenizer(directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(FIXTURE.read_text())
    return directory


@pytest.fixture(autouse=True)
def hub_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache of the test's own, and the hub out of reach unless a
    test serves one."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    return cache


class Engine:
    """``/v1/models`` (``root``, ``owned_by``), SGLang's ``/model_info`` and ``/tokenize``
    as the engines answer them; ``model`` is the directory whose files it tokenizes with,
    None for the emulator's words."""

    def __init__(
        self,
        model: Path | None,
        root: str | None = None,
        owned_by: str = "vllm",
        model_info: dict[str, Any] | None = None,
        failures: list[int] | None = None,
    ) -> None:
        self.tokenizer = (
            HFTokenizer(model / "tokenizer.json", model / "tokenizer_config.json")
            if model is not None
            else None
        )
        self.root = root
        self.owned_by = owned_by
        self.model_info = model_info
        self.failures = failures or []
        self.calls: list[str] = []

    async def get(self, model: str, path: str) -> tuple[int, bytes]:
        self.calls.append(f"GET {path}")
        if self.failures:
            return self.failures.pop(0), b"{}"
        if path == "/v1/models":
            card = {"id": model, "object": "model", "owned_by": self.owned_by, "root": self.root}
            return 200, msgspec.json.encode({"object": "list", "data": [card]})
        if path == "/model_info" and self.model_info is not None:
            return 200, msgspec.json.encode(self.model_info)
        return 404, b'{"detail": "Not Found"}'

    async def post(self, model: str, path: str, body: bytes) -> tuple[int, bytes]:
        self.calls.append(f"POST {path}")
        request = msgspec.json.decode(body)
        if self.tokenizer is None:
            ids = WordTokenizer(decodes=False).encode(request["prompt"])
        elif "messages" in request:
            try:
                ids = await self.tokenizer.chat(request["messages"], True)
            except TokenizeError as exc:
                return 400, msgspec.json.encode({"error": {"message": str(exc)}})
        else:
            ids = list(await self.tokenizer.prompt(request["prompt"]))
        return 200, msgspec.json.encode({"tokens": ids, "count": len(ids)})

    def tokenize_calls(self) -> int:
        return self.calls.count("POST /tokenize")


def pools_for(engine: Engine, **tokenizer: Any) -> Tokenizers:
    config = load_config(overrides={"tokenizer": tokenizer}, environ={})
    return Tokenizers(config, engine.post, get=engine.get)


def choice(pools: Tokenizers) -> dict[str, Any]:
    (pool,) = pools.describe()
    return pool


def cache_entry(cache: Path, repo: str, model: Path) -> Path:
    """A hub id's tokenizer files laid out as huggingface_hub caches them: each file a
    blob named by its hash, a snapshot of the commit linking to the blobs, and
    ``refs/main`` naming the commit. Returns the snapshot's directory."""
    entry = cache / f"models--{repo.replace('/', '--')}"
    snapshot = entry / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (entry / "blobs").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        data = (model / name).read_bytes()
        blob = hashlib.sha1(data).hexdigest()
        (entry / "blobs" / blob).write_bytes(data)
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / blob)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(COMMIT)
    return snapshot


async def test_the_directory_the_engine_reports_as_its_root_gives_hf(llama: Path) -> None:
    engine = Engine(llama, root=str(llama))
    pools = pools_for(engine)
    assert await pools.resolve(MODEL) == "hf"
    assert choice(pools)["description"] == f"hf: {llama / 'tokenizer.json'} (engine root)"
    assert choice(pools)["source"] == "engine"


async def test_hf_from_the_engines_root_sends_no_tokenize_per_request(llama: Path) -> None:
    engine = Engine(llama, root=str(llama))
    pools = pools_for(engine)
    await pools.resolve(MODEL)
    asked = engine.tokenize_calls()
    assert asked == 2  # the probes: one prompt, one chat
    for i in range(5):
        await pools.for_model(MODEL).prompt(f"a new prompt {i}")
        await pools.for_model(MODEL).chat([{"role": "user", "content": f"question {i}"}])
    assert engine.tokenize_calls() == asked


async def test_a_root_mounted_elsewhere_is_found_under_model_dirs_by_its_last_component(
    llama: Path,
) -> None:
    engine = Engine(llama, root="/engine-only/models/llama")
    pools = pools_for(engine, model_dirs=[str(llama.parent)])
    assert await pools.resolve(MODEL) == "hf"
    assert choice(pools)["source"] == "model_dirs"
    assert choice(pools)["path"] == str(llama / "tokenizer.json")


async def test_the_served_name_is_looked_up_under_model_dirs(llama: Path, tmp_path: Path) -> None:
    (tmp_path / MODEL).symlink_to(llama)
    pools = pools_for(Engine(llama, root=None), model_dirs=[str(tmp_path)])
    assert await pools.resolve(MODEL) == "hf"
    assert choice(pools)["path"] == str(tmp_path / MODEL / "tokenizer.json")


async def test_model_dirs_are_never_left_for_a_name_that_climbs_out_of_them(
    llama: Path, tmp_path: Path
) -> None:
    inside = tmp_path / "dirs"
    inside.mkdir()
    (tmp_path / "llama").symlink_to(llama)  # beside the model directory, not in it
    pools = pools_for(Engine(llama, root="../llama"), model_dirs=[str(inside)])
    assert await pools.resolve(MODEL) == "approximate"
    assert str(tmp_path / "llama") not in choice(pools)["detail"]


async def test_a_hub_id_root_is_found_in_the_hugging_face_cache(
    llama: Path, hub_environment: Path
) -> None:
    snapshot = cache_entry(hub_environment, "org/tiny-llama", llama)
    pools = pools_for(Engine(llama, root="org/tiny-llama"))
    assert await pools.resolve(MODEL) == "hf"
    assert choice(pools)["description"] == (
        f"hf: {snapshot / 'tokenizer.json'} (Hugging Face cache, org/tiny-llama)"
    )
    assert choice(pools)["source"] == "hf_cache"


async def test_the_engines_own_directory_comes_before_model_dirs_and_the_cache(
    llama: Path, hub_environment: Path
) -> None:
    cache_entry(hub_environment, "llama", llama)
    pools = pools_for(Engine(llama, root=str(llama)), model_dirs=[str(llama.parent)])
    await pools.resolve(MODEL)
    assert choice(pools)["source"] == "engine"


async def test_model_dirs_come_before_the_cache(llama: Path, hub_environment: Path) -> None:
    cache_entry(hub_environment, "llama", llama)
    pools = pools_for(Engine(llama, root="llama"), model_dirs=[str(llama.parent)])
    await pools.resolve(MODEL)
    assert choice(pools)["source"] == "model_dirs"


async def test_sglangs_tokenizer_path_gives_hf(llama: Path) -> None:
    engine = Engine(
        llama,
        root=MODEL,  # SGLang's /v1/models says the served name there
        owned_by="sglang",
        model_info={"model_path": "/elsewhere", "tokenizer_path": str(llama)},
    )
    pools = pools_for(engine)
    assert await pools.resolve(MODEL) == "hf"
    assert choice(pools)["detail"] == "engine tokenizer_path"


async def test_a_found_tokenizer_that_tokenizes_otherwise_than_the_engine_is_passed_over(
    llama: Path, other: Path, tmp_path: Path
) -> None:
    # The engine's root holds another model's tokenizer (vLLM run with --tokenizer).
    (tmp_path / MODEL).symlink_to(llama)
    pools = pools_for(Engine(llama, root=str(other)), model_dirs=[str(tmp_path)])
    assert await pools.resolve(MODEL) == "hf"
    assert choice(pools)["path"] == str(tmp_path / MODEL / "tokenizer.json")


async def test_with_only_a_wrong_tokenizer_found_the_pool_says_why_it_is_approximate(
    llama: Path, other: Path
) -> None:
    pools = pools_for(Engine(llama, root=str(other)))
    assert await pools.resolve(MODEL) == "approximate"
    detail = choice(pools)["detail"]
    assert detail.startswith("no tokenizer found (looked in ")
    assert f"{other / 'tokenizer.json'} tokenizes differently from the engine" in detail


async def test_a_found_tokenizer_whose_chat_template_renders_otherwise_is_passed_over(
    llama: Path, tmp_path: Path
) -> None:
    (tmp_path / "tokenizer.json").write_bytes((llama / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')  # no template
    pools = pools_for(Engine(llama, root=str(tmp_path)))
    assert await pools.resolve(MODEL) == "approximate"
    assert "chat template renders differently" in choice(pools)["detail"]


async def test_an_engine_that_tokenizes_like_the_emulator_gets_words(llama: Path) -> None:
    pools = pools_for(Engine(None, root=MODEL), model_dirs=[str(llama.parent)])
    assert await pools.resolve(MODEL) == "words"
    assert choice(pools)["description"] == "words: emulator probe"


async def test_with_no_tokenizer_found_auto_routes_approximate_never_asking_the_engine(
    llama: Path,
) -> None:
    engine = Engine(llama, root="/engine-only/models/llama")
    pools = pools_for(engine)
    assert await pools.resolve(MODEL) == "approximate"
    assert choice(pools)["source"] == "none"
    asked = engine.tokenize_calls()
    for i in range(5):
        assert pools.for_model(MODEL).mode == "approximate"
        await pools.for_model(MODEL).prompt(f"a new prompt {i}")
    assert engine.tokenize_calls() == asked == 1  # the probe alone


async def test_auto_never_resolves_to_engine_mode(llama: Path, other: Path) -> None:
    engines = [
        Engine(llama, root=None),
        Engine(llama, root=str(other)),
        Engine(llama, root="org/tiny-llama"),
        Engine(llama, root=str(llama)),
        Engine(None, root=MODEL),
    ]
    modes = [await pools_for(engine).resolve(MODEL) for engine in engines]
    assert modes == ["approximate", "approximate", "approximate", "hf", "words"]


async def test_a_busy_engine_leaves_the_pool_approximate_and_is_asked_again(
    llama: Path,
) -> None:
    now = [0.0]
    engine = Engine(llama, root=str(llama), failures=[503])
    config = load_config(environ={})
    pools = Tokenizers(config, engine.post, clock=lambda: now[0], get=engine.get)
    assert await pools.resolve(MODEL) == "approximate"
    assert choice(pools)["source"] == "pending"
    assert "asking again in 5 s" in choice(pools)["detail"]
    now[0] = 5.0
    pools.for_model(MODEL)
    await poll(lambda: pools.modes() == {MODEL: "hf"})


async def test_the_choice_is_logged_once_at_info(
    llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pools = pools_for(Engine(llama, root=str(llama)))
    with caplog.at_level(logging.INFO, logger="kvroute.tokenizer"):
        await asyncio.gather(pools.resolve(MODEL), pools.resolve(MODEL))
    lines = [r.getMessage() for r in caplog.records if r.name == "kvroute.tokenizer"]
    assert lines == [f"model {MODEL}: tokenizer hf: {llama / 'tokenizer.json'} (engine root)"]


# ------------------------------------------------------------------ the hub


class Hub:
    """A Hugging Face hub on loopback: ``/{repo}/resolve/{revision}/{file}`` answered as
    the hub answers huggingface_hub (the commit and ETag headers; a missing file or
    repository as a 404 with its ``X-Error-Code``)."""

    def __init__(self, repos: dict[str, Path], delay_s: float = 0.0) -> None:
        self.repos = repos
        self.delay_s = delay_s
        self.requests: list[str] = []

    async def resolve(self, request: web.Request) -> web.Response:
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        self.requests.append(f"{request.method} {repo} {request.match_info['file']}")
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if repo not in self.repos:
            return web.Response(status=404, headers={"X-Error-Code": "RepoNotFound"})
        path = self.repos[repo] / request.match_info["file"]
        if not path.is_file():
            return web.Response(status=404, headers={"X-Error-Code": "EntryNotFound"})
        data = path.read_bytes()
        etag = f'"{hashlib.sha1(data).hexdigest()}"'
        return web.Response(body=data, headers={"X-Repo-Commit": COMMIT, "ETag": etag})


@pytest_asyncio.fixture
async def serve_hub(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    """Start a :class:`Hub` and point ``HF_ENDPOINT`` at it, the hub allowed."""
    runners: list[web.AppRunner] = []

    async def start(hub: Hub) -> Hub:
        app = web.Application()
        app.router.add_get("/{org}/{name}/resolve/{revision}/{file}", hub.resolve)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.delenv("HF_HUB_OFFLINE")
        # huggingface_hub read HF_HUB_OFFLINE when imported: a suite run offline
        # would refuse this loopback hub too.
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        return hub

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_a_hub_id_root_is_fetched_from_the_hub_in_the_background(
    llama: Path, serve_hub: Any, hub_environment: Path
) -> None:
    hub = await serve_hub(Hub({"org/tiny-llama": llama}))
    pools = pools_for(Engine(llama, root="org/tiny-llama"))
    # Resolution does not wait for the hub: requests meanwhile use approximate keys.
    assert await pools.resolve(MODEL) == "approximate"
    assert choice(pools)["description"].startswith(
        "approximate: fetching the tokenizer of org/tiny-llama from the Hugging Face hub"
    )
    await poll(lambda: pools.modes() == {MODEL: "hf"}, timeout=30)
    assert choice(pools)["source"] == "hub"
    assert choice(pools)["path"].startswith(str(hub_environment / "models--org--tiny-llama"))
    assert {r.split()[-1] for r in hub.requests} == {
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    }
    # Now in the cache: the next router finds it there, without the hub.
    again = pools_for(Engine(llama, root="org/tiny-llama"))
    assert await again.resolve(MODEL) == "hf"
    assert choice(again)["source"] == "hf_cache"


@pytest.mark.parametrize(
    ("root", "owned_by"),
    [(None, "vllm"), ("org/private-model", "sglang")],  # SGLang's root is the served name
)
async def test_the_served_name_alone_is_never_asked_of_the_hub(
    llama: Path, serve_hub: Any, root: str | None, owned_by: str
) -> None:
    hub = await serve_hub(Hub({"org/private-model": llama}))
    pools = pools_for(Engine(llama, root=root, owned_by=owned_by))
    assert await pools.resolve("org/private-model") == "approximate"
    assert choice(pools)["source"] == "none"  # settled: no download in flight
    assert hub.requests == []


async def test_hf_hub_offline_keeps_the_router_off_the_hub(
    llama: Path, serve_hub: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = await serve_hub(Hub({"org/tiny-llama": llama}))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pools = pools_for(Engine(llama, root="org/tiny-llama"))
    assert await pools.resolve(MODEL) == "approximate"
    assert "not the hub (HF_HUB_OFFLINE)" in choice(pools)["detail"]
    assert choice(pools)["source"] == "none"  # settled: no download in flight
    assert hub.requests == []


async def test_download_off_keeps_the_router_off_the_hub(llama: Path, serve_hub: Any) -> None:
    hub = await serve_hub(Hub({"org/tiny-llama": llama}))
    pools = pools_for(Engine(llama, root="org/tiny-llama"), download=False)
    assert await pools.resolve(MODEL) == "approximate"
    assert "not the hub (tokenizer.download is off)" in choice(pools)["detail"]
    assert choice(pools)["source"] == "none"  # settled: no download in flight
    assert hub.requests == []


async def test_a_hub_that_does_not_answer_in_time_leaves_approximate(
    llama: Path, serve_hub: Any
) -> None:
    await serve_hub(Hub({"org/tiny-llama": llama}, delay_s=30))
    pools = pools_for(Engine(llama, root="org/tiny-llama"), download_timeout_s=0.5)
    await pools.resolve(MODEL)
    await poll(lambda: choice(pools)["source"] == "none", timeout=10)
    assert "org/tiny-llama: the hub did not answer within 0.5 s" in choice(pools)["detail"]
    # The download still waits on the hub, on a thread that never holds up an exit.
    waiting = [t for t in threading.enumerate() if t.name == "kvroute-hub org/tiny-llama"]
    assert waiting and all(t.daemon for t in waiting)


async def test_a_repository_the_hub_does_not_have_leaves_approximate(
    llama: Path, serve_hub: Any
) -> None:
    await serve_hub(Hub({}))
    pools = pools_for(Engine(llama, root="org/tiny-llama"))
    await pools.resolve(MODEL)
    await poll(lambda: choice(pools)["source"] == "none", timeout=30)
    assert "org/tiny-llama: RepositoryNotFoundError" in choice(pools)["detail"]


# ------------------------------------------------------------------ approximate mode


def text_of(chars: int, tag: int) -> str:
    return (f"answer {tag} " + "abcdefgh " * chars)[:chars]


async def observe_answers(pools: Tokenizers, n: int, chars_per_engine_token: int) -> None:
    """``n`` answers whose engine counted one token per ``chars_per_engine_token``."""
    for i in range(n):
        text = text_of(600, i)
        router_tokens = len(await pools.for_model(MODEL).prompt(text))
        pools.observe(MODEL, router_tokens, len(text) // chars_per_engine_token)


async def test_approximate_mode_measures_its_characters_per_token_from_the_engines_usage(
    llama: Path,
) -> None:
    pools = pools_for(Engine(llama, root=None))
    await pools.resolve(MODEL)
    await observe_answers(pools, CALIBRATION_ANSWERS - 1, 3)
    assert choice(pools)["chars_per_token"] == 4 and not choice(pools)["calibrated"]
    await observe_answers(pools, 1, 3)
    assert choice(pools)["chars_per_token"] == 3 and choice(pools)["calibrated"]
    # Match depths in tokens are now the engine's: 600 characters, 200 tokens.
    assert len(await pools.for_model(MODEL).prompt(text_of(600, 99))) == 200


async def test_configured_approximate_mode_keeps_its_characters_per_token(
    llama: Path,
) -> None:
    pools = pools_for(Engine(llama, root=None), mode="approximate", chars_per_token=5)
    await observe_answers(pools, CALIBRATION_ANSWERS * 2, 3)
    assert choice(pools)["chars_per_token"] == 5 and not choice(pools)["calibrated"]
