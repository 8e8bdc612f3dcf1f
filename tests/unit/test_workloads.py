"""The workload model (router/workloads/): trace parsing, expansion, generation, ceilings
and the statistics runs are judged by."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from router.tokenization.words import WordTokenizer
from router.workloads.ceilings import oracle_hit_rate, prefix_ceiling
from router.workloads.expansion import PromptExpander, trace_specs
from router.workloads.generated import chat_workload, next_turn, shared_prefix_workload
from router.workloads.spec import RequestSpec, spec_tokens
from router.workloads.stats import percentile
from router.workloads.traces import (
    TraceError,
    TraceRequest,
    parse_azure,
    parse_mooncake,
    read_trace,
    select,
)

TRACES = Path(__file__).parent.parent / "fixtures" / "traces"


def small() -> list[TraceRequest]:
    return list(read_trace(TRACES / "mooncake-small.jsonl").requests)


# ------------------------------------------------------------------------------ parsing


def test_mooncake_lines_parse_into_requests_with_arrivals_in_seconds() -> None:
    requests = small()
    assert [r.at for r in requests] == [0.0, 0.25, 1.0, 2.5]
    assert requests[0] == TraceRequest(0.0, 1100, 20, (0, 1, 2))
    assert requests[1].output_length == 0
    assert requests[3].hash_ids == (0,)


def test_a_gzipped_trace_reads_like_the_plain_one() -> None:
    assert read_trace(TRACES / "mooncake-small.jsonl.gz").requests == tuple(small())


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "output_length": 1, "hash_ids": [0]}', "'input_length'"),
        ('{"timestamp": -5, "input_length": 10, "output_length": 1}', "'timestamp'"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1}', "'input_length' must be >= 1"),
        ('{"timestamp": 0, "input_length": 10, "output_length": true}', "'output_length'"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": 7}', "list"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}', "list"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "expected"),
    ],
)
def test_a_malformed_mooncake_line_is_an_error_naming_its_line(line: str, reason: str) -> None:
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}'
    with pytest.raises(TraceError) as info:
        parse_mooncake([good, "", line], source="t.jsonl")
    assert info.value.line == 3
    assert str(info.value).startswith("t.jsonl, line 3: ")
    assert reason in str(info.value)


def test_a_malformed_trace_file_names_the_file_and_line() -> None:
    with pytest.raises(TraceError, match=r"mooncake-malformed\.jsonl, line 3: 2 hash_ids"):
        read_trace(TRACES / "mooncake-malformed.jsonl")


def test_requests_without_hash_ids_get_unique_blocks() -> None:
    lines = [
        '{"timestamp": 0, "input_length": 1000, "output_length": 1}',
        '{"timestamp": 1, "input_length": 1000, "output_length": 1}',
    ]
    a, b = parse_mooncake(lines)
    assert len(a.hash_ids) == 2
    assert not set(a.hash_ids) & set(b.hash_ids)
    assert oracle_hit_rate([a, b]) == 0.0


def test_azure_csv_gives_arrivals_lengths_and_unique_prompts() -> None:
    trace = read_trace(TRACES / "azure-small.csv")
    assert not trace.has_prefixes
    ats = [r.at for r in trace.requests]
    assert ats[0] == 0.0
    assert ats[1] == pytest.approx(4.314579, abs=1e-6)
    assert ats[2] == pytest.approx(4.8194100, abs=1e-6)
    assert [(r.input_length, r.output_length) for r in trace.requests] == [
        (374, 44),
        (1396, 109),
        (20, 0),
    ]
    assert [len(r.hash_ids) for r in trace.requests] == [1, 3, 1]
    assert oracle_hit_rate(trace.requests) == 0.0


def test_a_bad_azure_row_names_its_line() -> None:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:15:46.68,10,2", "x,y,z"]
    with pytest.raises(TraceError, match="line 3"):
        parse_azure(lines, source="a.csv")
    with pytest.raises(TraceError, match="line 1: expected a header"):
        parse_azure(["a,b,c"], source="a.csv")


def test_the_bundled_conversation_trace_has_its_published_oracle_hit_rate() -> None:
    trace = read_trace("mooncake-conversation")
    assert len(trace.requests) == 12_031
    assert oracle_hit_rate(trace.requests) == pytest.approx(0.366, abs=0.001)


def test_an_unknown_trace_name_says_what_exists() -> None:
    with pytest.raises(FileNotFoundError, match="mooncake-conversation"):
        read_trace("no-such-trace")


def test_select_compresses_time_and_limits_count_and_duration() -> None:
    requests = small()
    assert [r.at for r in select(requests, speedup=2)] == [0.0, 0.125, 0.5, 1.25]
    assert len(select(requests, limit=2)) == 2
    assert len(select(requests, duration=1.0)) == 3
    assert len(select(requests, speedup=2, duration=1.0)) == 3
    assert len(select(requests, speedup=4, duration=1.0)) == 4


# ------------------------------------------------------------------------------ expansion


def test_expansion_is_deterministic() -> None:
    a, b = PromptExpander(seed=3), PromptExpander(seed=3)
    for r in small():
        assert a.prompt(r) == b.prompt(r)
    assert PromptExpander(seed=4).prompt(small()[0]) != a.prompt(small()[0])


@pytest.mark.parametrize("prompt_format", ["text", "tokens"])
def test_equal_id_prefixes_give_equal_prefixes_and_different_ids_diverge(
    prompt_format: str,
) -> None:
    expander = PromptExpander(scale=0.25, prompt_format=prompt_format)  # type: ignore[arg-type]
    first, second, other, _ = small()
    block = expander.block_len
    assert block == 128
    a, b, c = expander.items(first), expander.items(second), expander.items(other)
    # [0, 1, 2] and [0, 1, 3]: the same two blocks, then different third blocks.
    assert a[: 2 * block] == b[: 2 * block]
    assert a[2 * block : 2 * block + 16] != b[2 * block : 2 * block + 16]
    # [4, 5] shares nothing with [0, ...]: their first engine blocks already differ.
    assert c[:16] != a[:16]


def test_prompts_are_cut_at_the_scaled_input_length() -> None:
    first, _, other, last = small()
    full = PromptExpander()
    assert len(full.items(first)) == 1100
    assert len(full.items(last)) == 512
    quarter = PromptExpander(scale=0.25)
    assert len(quarter.items(first)) == 275
    assert len(quarter.items(other)) == 150
    assert full.items(first)[:275] != quarter.items(first)  # blocks are redrawn, not cut


def test_text_prompts_are_one_emulator_token_per_word() -> None:
    expander = PromptExpander(scale=0.5)
    for r in small():
        prompt = expander.prompt(r)
        assert isinstance(prompt, str)
        assert len(WordTokenizer().encode(prompt)) == expander.length(r)


def test_token_prompts_are_ids_every_common_vocabulary_holds() -> None:
    prompt = PromptExpander(prompt_format="tokens").prompt(small()[0])
    assert isinstance(prompt, list)
    assert len(prompt) == 1100
    assert all(1_024 <= t < 32_000 for t in prompt)


def test_trace_specs_carry_arrivals_and_capped_output_lengths() -> None:
    specs = list(trace_specs(small(), PromptExpander(scale=0.1), max_output_tokens=16))
    assert [s.at for s in specs] == [0.0, 0.25, 1.0, 2.5]
    assert [s.max_tokens for s in specs] == [16, 1, 8, 16]
    closed = list(trace_specs(small(), PromptExpander(scale=0.1), timed=False))
    assert all(s.at is None for s in closed)
    assert [s.max_tokens for s in closed] == [20, 1, 8, 31]


# ------------------------------------------------------------------------------ generated


def test_chat_turns_append_the_previous_answer_and_a_new_question() -> None:
    first, other = chat_workload(2, 3, 50, 10, 8, think_s=0.5, seed=1)
    assert [m["role"] for m in first.messages or []] == ["system", "user"]
    assert (first.messages or [])[0] == (other.messages or [])[0]  # one application prompt
    assert (first.messages or [])[1] != (other.messages or [])[1]
    assert first.delay == 0.0
    assert first.then is not None
    second = first.then("the first answer")
    assert second is not None
    assert second.messages == next_turn(
        first.messages or [], "the first answer", (second.messages or [])[-1]["content"]
    )
    assert (second.messages or [])[2] == {"role": "assistant", "content": "the first answer"}
    assert second.delay == 0.5
    assert second.group == first.group == "conversation-0"
    assert second.then is not None
    third = second.then("the second answer")
    assert third is not None
    assert len(third.messages or []) == 6
    assert (third.messages or [])[:4] == second.messages
    assert third.then is not None
    assert third.then("the last answer") is None


def answer_lengths(spec: RequestSpec) -> list[int]:
    lengths = []
    turn: RequestSpec | None = spec
    while turn is not None:
        lengths.append(turn.max_tokens)
        turn = turn.then("an answer") if turn.then is not None else None
    return lengths


def test_an_output_spread_varies_answers_around_the_length_and_keeps_the_prompts() -> None:
    even = chat_workload(20, 6, 50, 10, 100, seed=3)
    spread = chat_workload(20, 6, 50, 10, 100, seed=3, output_spread=0.5)
    assert [s.messages for s in spread] == [s.messages for s in even]
    assert all(answer_lengths(s) == [100] * 6 for s in even)
    lengths = [n for s in spread for n in answer_lengths(s)]
    assert all(50 <= n <= 150 for n in lengths) and len(set(lengths)) > 30
    assert 90 <= sum(lengths) / len(lengths) <= 110
    again = chat_workload(20, 6, 50, 10, 100, seed=3, output_spread=0.5)
    assert [answer_lengths(s) for s in again] == [answer_lengths(s) for s in spread]
    with pytest.raises(ValueError, match="output_spread"):
        chat_workload(1, 1, 5, 5, 5, output_spread=1.0)


def test_shared_prefix_answers_vary_with_a_spread_and_the_prompts_do_not() -> None:
    even = shared_prefix_workload(6, 10, 40, 8, 64, seed=2)
    spread = shared_prefix_workload(6, 10, 40, 8, 64, seed=2, output_spread=0.5)
    assert [s.prompt for s in spread] == [s.prompt for s in even]
    assert {s.max_tokens for s in even} == {64}
    lengths = [s.max_tokens for s in spread]
    assert all(32 <= n <= 96 for n in lengths) and len(set(lengths)) > 20
    with pytest.raises(ValueError, match="output_spread"):
        shared_prefix_workload(1, 1, 5, 5, 5, output_spread=-0.1)


def test_samples_repeat_each_prompt_one_after_another() -> None:
    """Without a question and unshuffled, a group is n samples of one prompt, sent
    together (reinforcement-learning rollouts)."""
    specs = shared_prefix_workload(3, 4, 30, 0, 16, shuffle=False)
    assert [s.group for s in specs] == [f"group-{g}" for g in range(3) for _ in range(4)]
    prompts = [s.prompt for s in specs]
    assert all(prompts[4 * g : 4 * g + 4] == [prompts[4 * g]] * 4 for g in range(3))
    assert len(set(prompts)) == 3
    assert all(len(WordTokenizer().encode(p)) == 30 for p in prompts if isinstance(p, str))


def test_a_request_cap_keeps_whole_conversations_in_order_and_cuts_the_last() -> None:
    whole = chat_workload(4, 3, 50, 10, 8, seed=2)
    capped = chat_workload(4, 3, 50, 10, 8, seed=2, requests=5)
    assert [answer_lengths(s) for s in capped] == [[8, 8, 8], [8, 8]]
    assert [s.messages for s in capped] == [s.messages for s in whole[:2]]
    assert len(chat_workload(4, 3, 50, 10, 8, seed=2, requests=100)) == 4


def test_next_turn_leaves_the_earlier_messages_alone() -> None:
    messages = [{"role": "user", "content": "hi"}]
    following = next_turn(messages, "hello", "how are you")
    assert messages == [{"role": "user", "content": "hi"}]
    assert len(following) == 3


# ------------------------------------------------------------------------------ maths


def test_oracle_hit_rate_counts_blocks_that_repeat_an_earlier_block() -> None:
    # 9 blocks: [0, 1, 2], [0, 1, 3], [4, 5], [0]; ids 0, 1 repeat once and 0 again.
    assert oracle_hit_rate(small()) == pytest.approx(3 / 9)
    assert oracle_hit_rate([]) == 0.0


def test_prefix_ceiling_counts_whole_blocks_and_never_the_last_token() -> None:
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks of 16 can be served
    assert prefix_ceiling([(prompt, []), (prompt, [])], 16) == pytest.approx(32 / 80)
    assert prefix_ceiling([(prompt, [])], 16) == 0.0


def test_prefix_ceiling_credits_the_answer_an_engine_computed() -> None:
    first = list(range(100, 120))  # 20 prompt tokens
    answer = list(range(500, 520))  # 20 answer tokens: 39 computed tokens, 2 full blocks
    second = [*first, *answer, *range(900, 910)]
    assert prefix_ceiling([(first, answer), (second, [])], 16) == pytest.approx(32 / 70)


def test_spec_tokens_render_chats_like_the_emulator() -> None:
    (spec,) = chat_workload(1, 1, 5, 3, 4)
    tokens = spec_tokens(spec)
    # <|system|> 5 words <|end|> <|user|> 3 words <|end|> <|assistant|>
    assert len(tokens) == 5 + 3 + 5


def test_percentile_interpolates_linearly() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
