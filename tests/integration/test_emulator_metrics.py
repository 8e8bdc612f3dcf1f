"""/metrics under vLLM's names, parsed with prometheus_client's own parser."""

from __future__ import annotations

import aiohttp
from support.clients import metric, metrics, post

from router.emulator import EmulatedEngine


async def test_metrics_have_vllm_names_and_labels(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    samples = await metrics(http, engine.url)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        (sample,) = samples[name]
        assert sample.labels == {"model_name": "kvroute-emulated", "engine": "0"}, name
    (info,) = samples["vllm:cache_config_info"]
    assert info.value == 1
    assert (info.labels["block_size"], info.labels["num_gpu_blocks"]) == ("16", "1024")
    assert "vllm:time_to_first_token_seconds_bucket" in samples
    assert "vllm:e2e_request_latency_seconds_count" in samples


async def test_counters_move_by_what_requests_did(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    before = await metrics(http, engine.url)
    prompt = " ".join(f"m{i}" for i in range(2_000))
    for _ in range(2):
        status, _ = await post(
            http, f"{engine.url}/v1/completions", {"prompt": prompt, "max_tokens": 3}
        )
        assert status == 200
    after = await metrics(http, engine.url)

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert delta("vllm:prefix_cache_queries_total") == 4_000
    assert delta("vllm:prefix_cache_hits_total") == 1_984
    assert delta("vllm:prompt_tokens_total") == 4_000
    assert delta("vllm:generation_tokens_total") == 6
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
    assert metric(after, "vllm:num_requests_running") == 0
    assert metric(after, "vllm:kv_cache_usage_perc") == 0
