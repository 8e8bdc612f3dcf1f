"""The same workload through ``kvroute bench``'s runner against an emulated vLLM pool, an
emulated SGLang pool and an emulated TensorRT-LLM pool (each publishing its engine's
KV-event format): the router applies every stream and reaches the vLLM pool's
prefix-cache hit rate, within 5 points."""

from __future__ import annotations

from pathlib import Path

from support.clients import REQUEST_TIMEOUT_S
from support.engines import poll, start_test_engine
from support.routers import start_router

from router.bench import report
from router.bench.runner import run_target
from router.engine_model import EngineParams
from router.workloads.generated import shared_prefix_workload

#: Room for about three groups' prefixes per engine: where a group goes matters.
PARAMS = EngineParams(num_gpu_blocks=256, max_model_len=4096)


async def _hit_rate(ipc_dir: Path, kv_events_format: str) -> tuple[float, int]:
    engines = [
        await start_test_engine(
            engine_id=f"{kv_events_format}-{i}",
            params=PARAMS,
            kv_events_endpoint=f"ipc://{ipc_dir}/{kv_events_format}-pool-{i}",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
            kv_events_format=kv_events_format,
        )
        for i in range(3)
    ]
    urls = [e.url for e in engines]
    # Short decision records: the engines' own events carry the routing.
    app = await start_router(urls, policy={"provisional_ttl_s": 0.05})
    try:
        await poll(lambda: app.subscriber and app.subscriber.stats.replays["ok"] == 3)
        specs = shared_prefix_workload(6, 6, 640, 32, 4, seed=3)
        run = await run_target(
            kv_events_format, "policy:kv_cost", app.url, urls, specs, concurrency=3,
            sample_interval=0.05, quiet=True, timeout=REQUEST_TIMEOUT_S,
        )  # fmt: skip
        counters = app.ingestor.counters
        assert counters.skipped["unknown_parent"] == 0
        assert counters.skipped["malformed"] == 0
        applied = counters.blocks_stored
    finally:
        await app.stop()
        for engine in engines:
            await engine.stop()
    summary = report.summarize_run(run)
    assert summary["errors"] == 0 and summary["ok"] == len(specs)
    return summary["hit_rate"], applied


async def test_sglang_and_trtllm_pools_hit_like_a_vllm_pool_on_the_same_workload(
    ipc_dir: Path,
) -> None:
    vllm, vllm_blocks = await _hit_rate(ipc_dir, "v2-mixed")
    assert vllm_blocks > 0
    assert vllm > 0.5
    for kv_events_format in ("sglang", "trtllm"):
        rate, blocks = await _hit_rate(ipc_dir, kv_events_format)
        assert blocks > 0, kv_events_format  # the stream was applied
        assert abs(rate - vllm) <= 0.05, (kv_events_format, vllm, rate)
