"""The engine model's prefix cache and KV events with media items, as vLLM's."""

from __future__ import annotations

from router.engine_model import EngineModel, EngineParams, RequestSpec
from router.events.types import BlockStored, KVEvent
from router.media import MediaSpan

SMALL = EngineParams(block_size=16, num_gpu_blocks=1_000, max_model_len=8_192)
PROMPT = list(range(5_000, 5_100))  # 100 tokens: 6 cacheable blocks
CAT = (MediaSpan("cat", 21, 20),)  # placeholders in blocks 1 and 2
DOG = (MediaSpan("dog", 21, 20),)


def run(engine: EngineModel, *specs: RequestSpec) -> tuple[dict[str, int], list[KVEvent]]:
    """Submit, run to idle; cached tokens per request and the events published."""
    now = 0.0
    for spec in specs:
        engine.submit(spec, now)
    cached: dict[str, int] = {}
    events: list[KVEvent] = []
    while (duration := engine.start_step(now)) is not None:
        now += duration
        result = engine.finish_step(now)
        events += result.events
        for out in result.outputs:
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens
    return cached, events


def test_another_image_hits_only_the_blocks_before_it() -> None:
    engine = EngineModel(SMALL, hash_seed=1)
    run(engine, RequestSpec("cat", PROMPT, 1, media=CAT))
    cached, _ = run(engine, RequestSpec("dog", PROMPT, 1, media=DOG))
    assert cached == {"dog": 16}
    cached, _ = run(engine, RequestSpec("cat-again", PROMPT, 1, media=CAT))
    assert cached == {"cat-again": 6 * 16}
    cached, _ = run(engine, RequestSpec("text", PROMPT, 1))
    assert cached == {"text": 16}


def test_events_carry_vllms_extra_keys_in_its_order() -> None:
    engine = EngineModel(SMALL, hash_seed=1)
    spec = RequestSpec("r", PROMPT, 1, lora_name="sql", lora_id=1, cache_salt="tenant", media=CAT)
    _, events = run(engine, spec)
    stored = [e for e in events if isinstance(e, BlockStored)]
    extra = [k for e in stored for k in (e.extra_keys or [])]
    assert extra[:4] == [
        ["sql", "tenant"],
        ["sql", ("cat", 5)],
        ["sql", ("cat", -11)],
        ["sql"],
    ]
