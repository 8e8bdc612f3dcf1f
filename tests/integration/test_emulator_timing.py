"""The real-time driver: wall time is model time x --time-scale."""

from __future__ import annotations

import time

import aiohttp
import pytest
from support.clients import metrics, post
from support.engines import TEST_PARAMS, start_test_engine

from router.engine_model import EngineModel, RequestSpec
from router.tokenization import WordTokenizer

PROMPT = " ".join(f"t{i}" for i in range(1_000))
MAX_TOKENS = 60


def model_latency() -> tuple[float, float]:
    """(TTFT, e2e) of the request alone on an idle engine, on a virtual clock."""
    engine = EngineModel(TEST_PARAMS, hash_seed=1)
    engine.submit(RequestSpec("r", WordTokenizer().encode(PROMPT), MAX_TOKENS), 0.0)
    now, ttft = 0.0, None
    while engine.has_work:
        now += engine.start_step(now) or 0.0
        for out in engine.finish_step(now).outputs:
            ttft = out.ttft if out.ttft is not None else ttft
    assert ttft is not None
    return ttft, now


@pytest.mark.parametrize("time_scale", [0.5, 0.1])
async def test_wall_time_is_model_time_times_the_scale(
    http: aiohttp.ClientSession, time_scale: float
) -> None:
    ttft, e2e = model_latency()
    engine = await start_test_engine(time_scale=time_scale)
    try:
        start = time.perf_counter()
        status, _ = await post(
            http, f"{engine.url}/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS}
        )
        wall = time.perf_counter() - start
        samples = await metrics(http, engine.url)
    finally:
        await engine.stop()
    assert status == 200
    # Never early; late by at most scheduling noise.
    assert e2e * time_scale <= wall <= e2e * time_scale + 0.25
    # Latency metrics are in model seconds, whatever the scale, and exact.
    (ttft_sum,) = samples["vllm:time_to_first_token_seconds_sum"]
    (e2e_sum,) = samples["vllm:e2e_request_latency_seconds_sum"]
    assert ttft_sum.value == pytest.approx(ttft, rel=1e-6)
    assert e2e_sum.value == pytest.approx(e2e, rel=1e-6)
