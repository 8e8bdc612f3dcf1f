"""KV tiers end to end: an emulated engine with a CPU offload tier demotes a prefix from
its GPU cache, publishes the demotion (a tokenless CPU ``BlockStored`` before the GPU
``BlockRemoved``, vLLM's offloading-connector shape; SGLang's self-describing host
store; TensorRT-LLM's ``updated`` cache level), and the router keeps routing the prefix
there at the CPU tier's weight."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import pytest
from support.clients import metric_sum, metrics, post, post_reply
from support.engines import poll, start_test_engine
from support.routers import start_router

from router.engine_model import EngineParams
from router.hashing import block_keys, cacheable_blocks, seed_for
from router.index import Match
from router.types import EngineKey

MODEL = "kvroute-emulated"
BS = 16
#: A GPU cache of 48 blocks (768 tokens) beside an offload tier of 256 blocks.
OFFLOADING = EngineParams(num_gpu_blocks=48, max_model_len=768, num_cpu_blocks=256)
PLAIN = EngineParams(num_gpu_blocks=48, max_model_len=768)
PROMPT = " ".join(f"tier{i}" for i in range(321))  # 321 tokens: 20 whole blocks cacheable


def _filler(n: int) -> str:
    return " ".join(f"fill{n}w{i}" for i in range(600))


@pytest.mark.parametrize("kv_events_format", ["v2-mixed", "sglang", "trtllm"])
async def test_a_prefix_demoted_to_cpu_keeps_routing_to_its_engine_at_the_cpu_weight(
    ipc_dir: Path, http: aiohttp.ClientSession, kv_events_format: str
) -> None:
    offloader = await start_test_engine(
        engine_id=f"offloader-{kv_events_format}",
        params=OFFLOADING,
        kv_events_endpoint=f"ipc://{ipc_dir}/offloader-{kv_events_format}",
        kv_events_replay_endpoint=f"ipc://{ipc_dir}/offloader-{kv_events_format}-replay",
        kv_events_format=kv_events_format,
    )
    other = await start_test_engine(
        engine_id=f"plain-{kv_events_format}",
        params=PLAIN,
        kv_events_endpoint=f"ipc://{ipc_dir}/plain-{kv_events_format}",
        kv_events_replay_endpoint=f"ipc://{ipc_dir}/plain-{kv_events_format}-replay",
        kv_events_format=kv_events_format,
    )
    # Short-lived decision records: once they expire, only the engines' events count.
    app = await start_router(
        [offloader.url, other.url],
        # kv_cost's prefill term is in blocks, which the check below reads back.
        policy={"name": "kv_cost", "provisional_ttl_s": 0.2, "offload_weight": 0.8},
    )
    held_by = EngineKey(f"127.0.0.1:{offloader.port}")
    candidates = [held_by, EngineKey(f"127.0.0.1:{other.port}")]
    keys = block_keys(app.tokenizers.words.encode(PROMPT), BS, seed_for(MODEL))

    def match() -> Match | None:
        return app.index.lookup_now(keys, candidates).get(held_by)  # type: ignore[attr-defined]

    try:
        await poll(lambda: app.subscriber and app.subscriber.stats.replays["ok"] == 2)
        # Served by the offloading engine directly, so its GPU cache holds the prefix.
        status, _ = await post(
            http,
            f"{offloader.url}/v1/completions",
            {"model": MODEL, "prompt": PROMPT, "max_tokens": 1},
        )
        assert status == 200
        await poll(lambda: match() == Match(20))
        # Two long prompts evict it from the 48-block GPU cache into the CPU tier.
        for n in range(2):
            status, _ = await post(
                http,
                f"{offloader.url}/v1/completions",
                {"model": MODEL, "prompt": _filler(n), "max_tokens": 1},
            )
            assert status == 200
        # The GPU removals leave the CPU copies: every block is still held, offloaded.
        await poll(lambda: match() == Match(20, offloaded=20))
        if kv_events_format != "sglang":
            # vLLM's offload store and TensorRT-LLM's level move carry no tokens: they
            # are resolved by engine hash.
            assert app.ingestor.counters.tokenless_blocks >= 20
        assert app.ingestor.counters.skipped["tokenless_unresolved"] == 0

        reply = await post_reply(
            http, f"{app.url}/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
        )
        assert reply.status == 200
        assert reply.headers["x-kvroute-engine"] == held_by.label
        summary = reply.headers["x-kvroute-reason"]
        assert "prefix_hit match=20" in summary
        # Offloaded blocks count at the CPU weight: 20 blocks are worth 16 GPU blocks.
        isl = reply.body["usage"]["prompt_tokens"]
        cached = min(int(20 * 0.8 * BS), cacheable_blocks(isl, BS) * BS)
        prefill = float(re.search(r"prefill=([0-9.]+)", summary).group(1))  # type: ignore[union-attr]
        assert prefill == pytest.approx(2.0 * (isl - cached) / BS, abs=0.05)
        # The engine loaded the prefix back from its CPU tier instead of recomputing it,
        # and registered it on the GPU again (the CPU copy stays).
        assert reply.body["usage"]["prompt_tokens_details"]["cached_tokens"] == 20 * BS
        await poll(lambda: match() == Match(20))
        samples = await metrics(http, app.url)
        assert metric_sum(samples, "kvroute_kv_events_skipped", reason="unknown_parent") == 0
    finally:
        await app.stop()
        await offloader.stop()
        await other.stop()
