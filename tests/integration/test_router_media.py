"""Chats with images through kvroute serve and emulated engines: the same text with
another image never counts as a cache match, at the router (its decision's match
depth, its index fed by KV events) or at the engine (``cached_tokens``); the same
image twice does."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest_asyncio
from support.clients import Reply, post, post_reply
from support.engines import poll, start_test_engine
from support.routers import start_router

from router.app import RouterApp
from router.emulator import EmulatedEngine
from router.hashing import block_keys, seed_for
from router.media import block_extra_keys
from router.types import EngineKey

MODEL = "kvroute-emulated"
BS = 16
PLACEHOLDERS = 24  # not the default: the router and the engines must agree on it
INTRO = " ".join(f"intro{i}" for i in range(40))  # <|user|> + 40 words: the image opens block 2
QUESTION = " ".join(f"ask{i}" for i in range(30))
#: <|user|>, 40 words, 24 placeholders, 30 words, <|end|>, <|assistant|>.
PROMPT_TOKENS = 1 + 40 + PLACEHOLDERS + 30 + 2
CACHEABLE = (PROMPT_TOKENS - 1) // BS


def image_chat(url: str, **part: Any) -> dict[str, Any]:
    content = [
        {"type": "text", "text": INTRO},
        {"type": "image_url", "image_url": {"url": url}, **part},
        {"type": "text", "text": QUESTION},
    ]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}


def match_depth(reply: Reply) -> int:
    found = re.search(r"match=(\d+)", reply.headers["x-kvroute-reason"])
    assert found, reply.headers
    return int(found.group(1))


def cached_tokens(reply: Reply) -> int:
    return reply.body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest_asyncio.fixture
async def engines(ipc_dir: Path) -> AsyncIterator[list[EmulatedEngine]]:
    started = [
        await start_test_engine(
            engine_id=f"media{i}",
            kv_events_endpoint=f"ipc://{ipc_dir}/media{i}",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
            mm_placeholder_tokens=PLACEHOLDERS,
        )
        for i in range(2)
    ]
    yield started
    for engine in started:
        await engine.stop()


@pytest_asyncio.fixture
async def router(engines: list[EmulatedEngine]) -> AsyncIterator[RouterApp]:
    # Short-lived decision records: what lasts is what the engines' events said.
    app = await start_router(
        [e.url for e in engines],
        policy={"provisional_ttl_s": 0.3},
        tokenizer={"mm_placeholder_tokens": PLACEHOLDERS},
    )
    await poll(lambda: app.subscriber and app.subscriber.stats.replays["ok"] == 2)
    yield app
    await app.stop()


async def test_another_image_never_matches_and_the_same_image_does(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    url = f"{router.url}/v1/chat/completions"
    cat = image_chat("https://img.example/cat.png")
    first = await post_reply(http, url, cat)
    assert first.status == 200, first.body
    assert first.body["usage"]["prompt_tokens"] == PROMPT_TOKENS
    served = first.headers["x-kvroute-engine"]

    # The engine's events alone (decision records expired) give the cat chat's keys.
    tokenizer = router.tokenizers.for_model(MODEL)
    prompt = await tokenizer.chat_prompt(cat["messages"])
    keys = block_keys(prompt.tokens, BS, seed_for(MODEL), extra=block_extra_keys(prompt.media, BS))
    engine = EngineKey(served)

    def indexed_depth() -> int:
        match = router.index.lookup_now(keys, [engine]).get(engine)  # type: ignore[attr-defined]
        return match.blocks if match else 0

    await poll(lambda: indexed_depth() == CACHEABLE, timeout=10)

    # Same text, another image: only the two blocks before the image match, anywhere.
    dog = await post_reply(http, url, image_chat("https://img.example/dog.png"))
    assert dog.status == 200, dog.body
    same_engine = dog.headers["x-kvroute-engine"] == served
    assert match_depth(dog) == (2 if same_engine else 0)
    assert cached_tokens(dog) == (2 * BS if same_engine else 0)

    # The same image again: the whole cacheable prompt, on the engine that holds it.
    again = await post_reply(http, url, cat)
    assert again.status == 200, again.body
    assert again.headers["x-kvroute-engine"] == served
    assert match_depth(again) == CACHEABLE
    assert cached_tokens(again) == CACHEABLE * BS
    # The router counted the placeholders as the engine did: no tokenizer mismatch.
    assert router.tokenizers.mismatches() == {MODEL: 0}


async def test_a_client_uuid_names_the_image_for_router_and_engine(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    url = f"{router.url}/v1/chat/completions"
    first = await post_reply(http, url, image_chat("https://cdn-a.example/p.png", uuid="photo-9"))
    assert first.status == 200, first.body
    # The same uuid behind another URL is the same item to both.
    mirror = await post_reply(http, url, image_chat("https://cdn-b.example/p.png", uuid="photo-9"))
    assert mirror.status == 200, mirror.body
    assert mirror.headers["x-kvroute-engine"] == first.headers["x-kvroute-engine"]
    assert match_depth(mirror) == CACHEABLE
    assert cached_tokens(mirror) == CACHEABLE * BS
    other = await post_reply(http, url, image_chat("https://cdn-a.example/p.png", uuid="photo-10"))
    assert other.status == 200, other.body
    assert match_depth(other) <= 2
    assert cached_tokens(other) <= 2 * BS


async def test_a_media_part_without_data_is_refused_by_the_router(
    router: RouterApp, http: aiohttp.ClientSession
) -> None:
    body = image_chat("")
    status, answer = await post(http, f"{router.url}/v1/chat/completions", body)
    assert status == 400
    assert "non-empty URL" in answer["error"]["message"]
    assert answer["error"]["param"] == "messages"
