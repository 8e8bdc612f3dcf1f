"""A data-parallel SGLang server behind the router: SGLang picks a rank from the body's
``data_parallel_rank`` (not vLLM's header), so the router names the rank it chose there,
and each rank's KV events land on the rank that served the request."""

from __future__ import annotations

from pathlib import Path

import aiohttp
from support.clients import post_reply
from support.engines import poll, start_test_engine
from support.routers import start_router

from router.hashing import block_keys, seed_for
from router.serving.forward import with_dp_rank
from router.types import EngineKey

MODEL = "kvroute-emulated"


def test_with_dp_rank_sets_the_body_field_and_leaves_other_bodies() -> None:
    assert with_dp_rank(b'{"prompt": "x"}', 1) == b'{"prompt":"x","data_parallel_rank":1}'
    assert with_dp_rank(b"[1, 2]", 1) == b"[1, 2]"
    assert with_dp_rank(b"not json", 1) == b"not json"


async def test_each_request_reaches_the_rank_the_router_chose(
    ipc_dir: Path, http: aiohttp.ClientSession
) -> None:
    engine = await start_test_engine(
        engine_id="sglang-dp",
        dp_size=2,
        kv_events_endpoint=f"ipc://{ipc_dir}/sglang-dp",
        kv_events_replay_endpoint=f"ipc://{ipc_dir}/sglang-dp-replay",
        kv_events_format="sglang",
    )
    # Short decision records, so a rank's holding is what its own events say.
    app = await start_router([engine.url], policy={"provisional_ttl_s": 0.05})
    ranks = [EngineKey(f"127.0.0.1:{engine.port}", r) for r in range(2)]
    try:
        await poll(lambda: app.subscriber and app.subscriber.stats.replays["ok"] == 2)
        await poll(lambda: app.registry.get(ranks[0].endpoint).sglang)
        chosen: dict[str, str] = {}
        for i in range(4):
            prompt = " ".join(f"dp{i}w{j}" for j in range(96))
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            first = await post_reply(http, f"{app.url}/v1/completions", body)
            assert first.status == 200
            chosen[prompt] = first.headers["x-kvroute-engine"]
            # The same prompt again goes to the same rank, and that rank has it cached
            # (an engine picking ranks round robin would serve it on the other one, cold).
            again = await post_reply(http, f"{app.url}/v1/completions", body)
            assert again.headers["x-kvroute-engine"] == chosen[prompt]
            assert again.body["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
        assert len(set(chosen.values())) == 2  # both ranks served

        def holders(prompt: str) -> set[str]:
            keys = block_keys(app.tokenizers.words.encode(prompt), 16, seed_for(MODEL))
            found = app.index.lookup_now(keys, ranks)  # type: ignore[attr-defined]
            return {k.label for k, m in found.items() if m.blocks}

        for prompt, label in chosen.items():
            # Each prompt's blocks are held by the rank the router named, and only there.
            await poll(lambda p=prompt, lab=label: holders(p) == {lab})
    finally:
        await app.stop()
        await engine.stop()
