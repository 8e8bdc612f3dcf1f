"""Reading engines' /metrics (router/fleet/scrape.py): load gauges per DP rank, and the
block size from vllm:cache_config_info or sglang:cache_config_info."""

from __future__ import annotations

from router.fleet.scrape import parse_metrics

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 5.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_gpu_blocks="1000"} 1.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 123.0
"""

SGLANG = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 2.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 7.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.75
# TYPE sglang:cache_config_info gauge
sglang:cache_config_info{num_pages="5000",page_size="64"} 1.0
"""


def test_vllm_gauges_per_rank_and_the_block_size() -> None:
    scrape = parse_metrics(VLLM)
    assert scrape.block_size == 32
    assert set(scrape.ranks) == {0, 1}  # counters and cache_config_info add no rank
    r0, r1 = scrape.ranks[0], scrape.ranks[1]
    assert (r0.running, r0.waiting, r0.kv_usage) == (3.0, 5.0, 0.25)
    assert (r1.running, r1.waiting, r1.kv_usage) == (1.0, 0.0, 0.5)


def test_sglang_gauges_and_page_size() -> None:
    scrape = parse_metrics(SGLANG)
    assert scrape.block_size == 64
    (rank,) = scrape.ranks
    assert rank == 0
    sample = scrape.ranks[0]
    assert (sample.running, sample.waiting, sample.kv_usage) == (2.0, 7.0, 0.75)


def test_no_cache_config_means_no_block_size_and_garbage_is_skipped() -> None:
    text = "vllm:num_requests_running 4\nvllm:num_requests_waiting not-a-number\n"
    scrape = parse_metrics(text)
    assert scrape.block_size is None
    assert scrape.ranks[0].running == 4.0 and scrape.ranks[0].waiting is None


def test_sglangs_cache_config_marks_the_engine_as_sglang() -> None:
    from router.fleet.scrape import parse_metrics

    sglang = parse_metrics('sglang:cache_config_info{page_size="32"} 1.0\n')
    assert (sglang.block_size, sglang.sglang) == (32, True)
    vllm = parse_metrics('vllm:cache_config_info{block_size="16",engine="0"} 1.0\n')
    assert (vllm.block_size, vllm.sglang) == (16, False)
