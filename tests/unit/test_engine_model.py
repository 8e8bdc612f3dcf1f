"""The pure engine model on a virtual clock: cache hits, eviction, batching and timing."""

from __future__ import annotations

import pytest

from router.engine_model import (
    EngineModel,
    EngineParams,
    HandoffError,
    RequestOutput,
    RequestSpec,
    preset,
)
from router.events.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

SMALL = EngineParams(block_size=16, num_gpu_blocks=1_000, max_model_len=8_192)


def prompt(n: int, start: int = 5_000) -> list[int]:
    return list(range(start, start + n))


class Run:
    """Drives an engine on a virtual clock and records what it reports."""

    def __init__(self, engine: EngineModel, now: float = 0.0) -> None:
        self.engine = engine
        self.now = now
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.events: list[KVEvent] = []
        self.durations: list[float] = []
        self.preempted: list[str] = []

    def submit(self, rid: str, tokens: list[int], max_tokens: int = 1, **kw) -> None:
        self.engine.submit(RequestSpec(rid, tokens, max_tokens, **kw), self.now)

    def step(self) -> bool:
        """Run one step; jump the clock to the next timed event while none can run."""
        duration = self.engine.start_step(self.now)
        while duration is None:
            self.events.extend(self.engine.take_events())
            wakeup = self.engine.next_wakeup()
            if not self.engine.has_work or wakeup is None:
                return False
            self.now = max(self.now, wakeup)
            duration = self.engine.start_step(self.now)
        self.durations.append(duration)
        self.now += duration
        result = self.engine.finish_step(self.now)
        for out in result.outputs:
            self.outputs.setdefault(out.request_id, []).append(out)
        self.events.extend(result.events)
        self.preempted.extend(result.preempted)
        return True

    def until_idle(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.step():
                return
        raise AssertionError("engine did not go idle")

    def tokens(self, rid: str) -> list[int]:
        return [t for out in self.outputs[rid] for t in out.new_token_ids]

    def cached(self, rid: str) -> int:
        return self.outputs[rid][0].num_cached_tokens


def test_repeated_prompt_hits_everything_but_the_last_token() -> None:
    run = Run(EngineModel(SMALL, hash_seed=1))
    run.submit("a", prompt(2_000))
    run.until_idle()
    run.submit("b", prompt(2_000))
    run.until_idle()
    assert (run.cached("a"), run.cached("b")) == (0, 1_984)


def test_prompt_of_whole_blocks_never_reuses_its_last_block() -> None:
    run = Run(EngineModel(SMALL, hash_seed=1))
    run.submit("a", prompt(32))
    run.until_idle()
    run.submit("b", prompt(32))
    run.until_idle()
    assert run.cached("b") == 16


def test_a_shared_prefix_hits_up_to_the_first_differing_block() -> None:
    run = Run(EngineModel(SMALL, hash_seed=1))
    run.submit("a", prompt(100))
    run.until_idle()
    run.submit("b", prompt(40) + prompt(60, start=90_000))
    run.until_idle()
    assert run.cached("b") == 32


def test_cache_salt_and_lora_isolate_prefixes() -> None:
    run = Run(EngineModel(SMALL, hash_seed=1))
    run.submit("plain", prompt(100))
    run.until_idle()
    run.submit("salted", prompt(100), cache_salt="tenant-a")
    run.submit("adapter", prompt(100), lora_name="sql", lora_id=1)
    run.until_idle()
    run.submit("salted-again", prompt(100), cache_salt="tenant-a")
    run.until_idle()
    assert (run.cached("salted"), run.cached("adapter"), run.cached("salted-again")) == (0, 0, 96)


def test_block_hashes_are_opaque_per_engine_seed() -> None:
    def first_hashes(seed: int) -> list[int]:
        run = Run(EngineModel(SMALL, hash_seed=seed))
        run.submit("a", prompt(64))
        run.until_idle()
        stored = [e for e in run.events if isinstance(e, BlockStored)]
        return stored[0].block_hashes

    assert first_hashes(1) == first_hashes(1)
    assert first_hashes(1) != first_hashes(2)


def test_stored_events_chain_and_carry_tokens_and_salt_on_the_first_block() -> None:
    run = Run(EngineModel(SMALL, hash_seed=1))
    run.submit("a", prompt(40), max_tokens=30, cache_salt="s")
    run.until_idle()
    stored = [e for e in run.events if isinstance(e, BlockStored)]
    first, rest = stored[0], stored[1:]
    assert first.parent_block_hash is None and first.token_ids == prompt(32)
    assert first.extra_keys == [["s"], None] and first.medium == "GPU"
    assert first.block_size == 16
    # Generated tokens fill and cache further blocks, each chained to the previous one.
    parent = first.block_hashes[-1]
    for event in rest:
        assert event.parent_block_hash == parent
        parent = event.block_hashes[-1]
    assert sum(len(e.block_hashes) for e in stored) == (40 + 30 - 1) // 16


def test_generated_tokens_are_cached_for_the_next_turn() -> None:
    run = Run(EngineModel(SMALL, hash_seed=1))
    run.submit("turn1", prompt(50), max_tokens=40)
    run.until_idle()
    follow_up = prompt(50) + run.tokens("turn1") + prompt(20, start=70_000)
    run.submit("turn2", follow_up)
    run.until_idle()
    # Everything computed in turn 1 (prompt + answer minus its last token), whole blocks.
    assert run.cached("turn2") == (50 + 40 - 1) // 16 * 16


def test_outputs_are_a_function_of_the_prompt() -> None:
    a = Run(EngineModel(SMALL, hash_seed=1))
    b = Run(EngineModel(SMALL, hash_seed=2))
    for run in (a, b):
        run.submit("x", prompt(30), max_tokens=12)
        run.submit("y", prompt(30), max_tokens=12, sample_seed=1)
        run.until_idle()
    assert a.tokens("x") == b.tokens("x") and len(a.tokens("x")) == 12
    assert a.tokens("x") != a.tokens("y")


def test_lru_evicts_only_unreferenced_blocks_and_reports_them() -> None:
    params = EngineParams(block_size=4, num_gpu_blocks=8, max_model_len=32)
    run = Run(EngineModel(params, hash_seed=1))
    run.submit("old", prompt(9, start=100))  # 3 blocks, 2 of them full and cached
    run.until_idle()
    old_hashes = [h for e in run.events if isinstance(e, BlockStored) for h in e.block_hashes]
    run.submit("long", prompt(20, start=200), max_tokens=4)  # needs 6 of the 8 blocks
    run.step()
    assert not any(isinstance(e, BlockRemoved) for e in run.events)
    run.submit("new", prompt(9, start=300))  # 3 more: the old request's blocks must go
    run.until_idle()
    removed = [h for e in run.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    # The released tail goes first; blocks held by the running request are never taken.
    assert removed and set(removed) <= set(old_hashes)
    assert len(run.tokens("long")) == 4 and not run.preempted


def test_a_released_sequence_is_evicted_tail_first() -> None:
    params = EngineParams(block_size=4, num_gpu_blocks=4, max_model_len=16)
    run = Run(EngineModel(params, hash_seed=1))
    run.submit("a", prompt(13, start=100))  # 4 blocks, 3 cached
    run.until_idle()
    stored = [h for e in run.events if isinstance(e, BlockStored) for h in e.block_hashes]
    run.submit("b", prompt(5, start=900))  # needs 2 blocks: the fresh-never block is gone
    run.until_idle()
    removed = [h for e in run.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == [stored[2]]  # the partial last block was unhashed, then the tail


def test_admission_waits_for_free_blocks() -> None:
    params = EngineParams(block_size=4, num_gpu_blocks=6, max_model_len=24)
    run = Run(EngineModel(params, hash_seed=1))
    run.submit("a", prompt(16, start=100), max_tokens=4)
    run.submit("b", prompt(16, start=200), max_tokens=4)
    run.step()
    stats = run.engine.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    run.until_idle()
    assert len(run.tokens("a")) == len(run.tokens("b")) == 4


def test_decode_out_of_blocks_preempts_the_newest_by_recompute() -> None:
    params = EngineParams(block_size=4, num_gpu_blocks=8, max_model_len=32)
    reference = Run(EngineModel(params, hash_seed=1))
    for rid in ("a", "b"):
        reference.submit(rid, prompt(12, start=100 if rid == "a" else 500), max_tokens=12)
        reference.until_idle()
    run = Run(EngineModel(params, hash_seed=1))
    run.submit("a", prompt(12, start=100), max_tokens=12)
    run.submit("b", prompt(12, start=500), max_tokens=12)
    run.until_idle()
    assert run.preempted and run.preempted[0] == "b"
    assert run.engine.stats().num_preemptions == len(run.preempted)
    # Recompute is invisible in the output: same tokens as when run alone.
    assert run.tokens("a") == reference.tokens("a")
    assert run.tokens("b") == reference.tokens("b")


def test_chunked_prefill_spends_at_most_the_token_budget_per_step() -> None:
    params = SMALL.replace(max_num_batched_tokens=512, step_overhead_s=0.01, prefill_token_s=1e-4)
    run = Run(EngineModel(params, hash_seed=1))
    run.submit("a", prompt(1_200))
    run.until_idle()
    assert run.durations == pytest.approx([0.01 + 512e-4, 0.01 + 512e-4, 0.01 + 176e-4])
    assert run.outputs["a"][0].ttft == pytest.approx(sum(run.durations))


def test_running_decodes_share_the_budget_with_a_new_prefill() -> None:
    params = SMALL.replace(
        max_num_batched_tokens=100,
        step_overhead_s=0.0,
        prefill_token_s=1e-3,
        decode_seq_s=1.0,
        context_token_s=0.0,
    )
    run = Run(EngineModel(params, hash_seed=1))
    run.submit("a", prompt(10), max_tokens=10)
    run.step()
    run.submit("b", prompt(500, start=50_000))
    run.step()
    # The running decode goes first (1 token); b's first chunk gets the other 99.
    assert run.durations[-1] == pytest.approx(1.0 + 99e-3)
    run.until_idle()
    assert len(run.tokens("a")) == 10 and len(run.tokens("b")) == 1


def test_max_num_seqs_caps_the_batch() -> None:
    params = SMALL.replace(max_num_seqs=2)
    run = Run(EngineModel(params, hash_seed=1))
    for i in range(3):
        run.submit(str(i), prompt(10, start=1_000 * (i + 1)), max_tokens=5)
    run.step()
    stats = run.engine.stats()
    assert (stats.num_running, stats.num_waiting) == (2, 1)


def test_decode_step_time_grows_with_batch_size_and_context() -> None:
    params = SMALL.replace(
        step_overhead_s=0.005, prefill_token_s=0.0, decode_seq_s=1e-4, context_token_s=1e-6
    )

    def decode_step(batch: int) -> float:
        run = Run(EngineModel(params, hash_seed=1))
        for i in range(batch):
            run.submit(str(i), prompt(100, start=1_000 * (i + 1)), max_tokens=3)
        run.step()  # prefill of all
        run.step()  # first decode step
        return run.durations[-1]

    assert decode_step(1) == pytest.approx(0.005 + 1e-4 + 100e-6)
    assert decode_step(8) == pytest.approx(0.005 + 8 * (1e-4 + 100e-6))


def test_abort_frees_blocks_and_drops_the_inflight_result() -> None:
    run = Run(EngineModel(SMALL, hash_seed=1))
    run.submit("a", prompt(100), max_tokens=50)
    run.step()
    assert run.engine.start_step(run.now) is not None
    assert run.engine.abort("a", run.now)
    result = run.engine.finish_step(run.now + 0.01)
    assert result.outputs == []
    stats = run.engine.stats()
    assert (stats.num_running, stats.kv_cache_usage) == (0, 0.0)
    assert not run.engine.abort("a", run.now)


def test_reset_is_refused_while_busy_and_clears_when_idle() -> None:
    run = Run(EngineModel(SMALL, hash_seed=1))
    run.submit("a", prompt(100), max_tokens=5)
    run.step()
    assert not run.engine.reset_prefix_cache(run.now)
    run.until_idle()
    assert run.engine.reset_prefix_cache(run.now)
    assert run.engine.take_events() == [AllBlocksCleared()]
    run.submit("b", prompt(100))
    run.until_idle()
    assert run.cached("b") == 0


def test_counters_follow_vllm_definitions() -> None:
    run = Run(EngineModel(SMALL, hash_seed=1))
    run.submit("a", prompt(2_000), max_tokens=3)
    run.until_idle()
    run.submit("b", prompt(2_000), max_tokens=2)
    run.until_idle()
    s = run.engine.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (4_000, 1_984)
    assert (s.prompt_tokens, s.generation_tokens) == (4_000, 5)


def test_requests_that_cannot_fit_are_rejected_up_front() -> None:
    engine = EngineModel(SMALL, hash_seed=1)
    with pytest.raises(ValueError, match="maximum context length is 8192"):
        engine.submit(RequestSpec("a", prompt(8_000), 500), 0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.submit(RequestSpec("a", prompt(10), 0), 0.0)


def test_presets_and_overrides() -> None:
    mocker = preset("dynamo-mocker")
    assert (mocker.block_size, mocker.num_gpu_blocks) == (64, 16_384)
    assert (mocker.max_num_batched_tokens, mocker.max_num_seqs) == (8_192, 256)
    assert preset("h100-8b", max_num_seqs=4, block_size=None).max_num_seqs == 4
    with pytest.raises(ValueError, match="unknown preset"):
        preset("nope")
    with pytest.raises(ValueError, match="does not fit"):
        EngineParams(num_gpu_blocks=10, max_model_len=1_000)


def test_a_prompt_admitted_in_the_same_step_hits_blocks_scheduled_before_it() -> None:
    """vLLM caches blocks when a step that fills them is scheduled, not when it ends."""
    run = Run(EngineModel(SMALL, hash_seed=1))
    run.submit("first", prompt(2_000))
    run.submit("second", [*prompt(2_000), 9])
    run.until_idle()
    assert run.cached("first") == 0
    assert run.cached("second") == 2_000  # all 125 blocks "first" filled in that step
    assert len(run.durations) == 1  # both were admitted together in one step


# ---------------------------------------------------------------------- disaggregation

#: 1 KiB of KV per token over a 1 MB/s link: 1 ms of transfer per token.
LINK = SMALL.replace(kv_bytes_per_token=1_000, kv_transfer_bandwidth=1e6, kv_hold_timeout_s=30.0)


def test_a_prefill_leg_keeps_its_blocks_after_finishing() -> None:
    run = Run(EngineModel(LINK, hash_seed=1))
    run.submit("p", prompt(100), remote_decode=True)
    run.until_idle()
    (out,) = run.outputs["p"]
    assert out.finished and out.finish_reason == "length"
    assert out.held is not None and out.held.prompt_token_ids == tuple(prompt(100))
    assert len(out.held.block_ids) == 7  # the 100 computed prompt tokens
    stats = run.engine.stats()
    assert (stats.num_held_requests, stats.num_held_blocks) == (1, 7)
    assert stats.kv_cache_usage == pytest.approx(7 / 1_000)


def test_a_claimed_hold_is_freed_on_release_and_cannot_be_pulled_twice() -> None:
    run = Run(EngineModel(LINK, hash_seed=1))
    run.submit("p", prompt(100), remote_decode=True)
    run.until_idle()
    held = run.outputs["p"][0].held
    assert held is not None
    assert run.engine.claim_hold("p", held.block_ids, run.now) == held
    with pytest.raises(HandoffError, match="already being pulled") as busy:
        run.engine.claim_hold("p", None, run.now)
    assert busy.value.reason == "already_pulled"
    assert run.engine.release_hold("p", run.now)
    assert run.engine.stats().kv_cache_usage == 0.0
    with pytest.raises(HandoffError, match="already pulled") as again:
        run.engine.claim_hold("p", None, run.now)
    assert again.value.reason == "already_pulled"


def test_claims_of_unknown_requests_or_other_blocks_fail() -> None:
    run = Run(EngineModel(LINK, hash_seed=1))
    run.submit("p", prompt(40), remote_decode=True)
    run.until_idle()
    with pytest.raises(HandoffError) as unknown:
        run.engine.claim_hold("nobody", None, run.now)
    with pytest.raises(HandoffError) as mismatch:
        run.engine.claim_hold("p", [0, 1, 99], run.now)
    assert (unknown.value.reason, mismatch.value.reason) == ("unknown", "block_mismatch")


def test_an_unclaimed_hold_expires_after_the_timeout() -> None:
    run = Run(EngineModel(LINK, hash_seed=1))
    run.submit("p", prompt(40), remote_decode=True)
    run.until_idle()
    finished_at = run.now
    assert run.engine.next_wakeup() == pytest.approx(finished_at + 30.0)
    run.engine.release_hold("other", finished_at + 29.9)
    assert run.engine.stats().num_held_requests == 1
    with pytest.raises(HandoffError, match="expired") as expired:
        run.engine.claim_hold("p", None, finished_at + 30.0)
    assert expired.value.reason == "expired"
    stats = run.engine.stats()
    assert (stats.num_held_requests, stats.num_expired_holds, stats.kv_cache_usage) == (0, 1, 0.0)
    assert run.engine.next_wakeup() is None


def test_a_decode_leg_waits_for_the_transfer_then_computes_one_token() -> None:
    params = LINK.replace(step_overhead_s=0.01, prefill_token_s=1e-3)
    run = Run(EngineModel(params, hash_seed=1))
    run.submit("d", prompt(100), max_tokens=3, remote_prefill=True)
    assert run.engine.start_step(run.now) is None  # admitted into the transfer only
    assert run.engine.stats().num_waiting == 1
    assert run.engine.next_wakeup() == pytest.approx(0.1)  # 100 tokens x 1 ms
    run.until_idle()
    first = run.outputs["d"][0]
    assert first.num_transferred_tokens == 100 and first.num_cached_tokens == 99
    # TTFT: the transfer, then one step computing the last prompt token.
    assert first.ttft == pytest.approx(0.1 + 0.01 + 1e-3)
    assert len(run.tokens("d")) == 3
    assert run.engine.stats().kv_transferred_tokens == 100


def test_a_decode_leg_pulls_only_what_it_does_not_cache_and_caches_the_rest() -> None:
    run = Run(EngineModel(LINK, hash_seed=1))
    run.submit("warm", prompt(40))
    run.until_idle()
    run.events.clear()
    run.submit("d", prompt(100), remote_prefill=True)
    run.until_idle()
    assert run.outputs["d"][0].num_transferred_tokens == 100 - 32
    stored = [h for e in run.events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert len(stored) == 99 // 16 - 2  # the imported full blocks join this engine's cache
    stats = run.engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (140, 32)
    run.submit("again", prompt(100))
    run.until_idle()
    assert run.cached("again") == 96


def test_the_same_prompt_gets_the_same_answer_through_a_handoff() -> None:
    alone = Run(EngineModel(LINK, hash_seed=1))
    alone.submit("x", prompt(60), max_tokens=8)
    alone.until_idle()
    split = Run(EngineModel(LINK, hash_seed=2))
    split.submit("x", prompt(60), max_tokens=8, remote_prefill=True)
    split.until_idle()
    assert split.tokens("x") == alone.tokens("x")


def test_aborting_a_transferring_decode_leg_frees_its_blocks() -> None:
    run = Run(EngineModel(LINK, hash_seed=1))
    run.submit("d", prompt(100), remote_prefill=True)
    assert run.engine.start_step(run.now) is None
    assert run.engine.stats().kv_cache_usage > 0
    assert run.engine.abort("d", run.now)
    stats = run.engine.stats()
    assert (stats.num_waiting, stats.kv_cache_usage, run.engine.has_work) == (0, 0.0, False)


def test_a_stop_token_ends_a_request_early() -> None:
    reference = Run(EngineModel(SMALL, hash_seed=1))
    reference.submit("r", prompt(30), max_tokens=5)
    reference.until_idle()
    third = reference.tokens("r")[2]
    run = Run(EngineModel(SMALL, hash_seed=1))
    run.submit("s", prompt(30), max_tokens=5, stop_token_ids=frozenset({third}))
    run.submit("m", prompt(30), max_tokens=5, stop_token_ids=frozenset({third}), min_tokens=4)
    run.until_idle()
    last = run.outputs["s"][-1]
    assert run.tokens("s") == reference.tokens("r")[:3]
    assert (last.finish_reason, last.stop_reason) == ("stop", third)
    assert run.outputs["m"][-1].finish_reason == "length"


def test_a_request_waits_for_the_first_step_after_its_arrival() -> None:
    engine = EngineModel(SMALL, hash_seed=1)
    engine.submit(RequestSpec("a", prompt(32), 1), 0.0)
    # A driver that woke late for "a" submits "b" with a later time than the step's.
    engine.submit(RequestSpec("b", prompt(32, start=9_000), 1), 5.0)
    duration = engine.start_step(0.0)
    assert duration is not None and duration < 5.0
    assert [o.request_id for o in engine.finish_step(duration).outputs] == ["a"]
    # Nothing runs before "b" arrives, and the model says when it does.
    assert engine.start_step(duration) is None
    assert engine.next_wakeup() == 5.0
    d = engine.start_step(5.0)
    assert d is not None
    (b,) = engine.finish_step(5.0 + d).outputs
    assert b.request_id == "b" and b.ttft == pytest.approx(d)
    # Once "b" is scheduled, an idle engine has nothing timed left.
    assert engine.next_wakeup() is None
