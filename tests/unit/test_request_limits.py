"""Request limits and hostile bodies: every one a 400 in OpenAI's form, never a crash."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from router.config import LimitsConfig
from router.frontends.http.anthropic import parse_messages
from router.frontends.http.responses_api import parse_responses
from router.serving.errors import ApiError
from router.serving.parsing import ParsedRequest, decode_body, parse_chat, parse_completion
from router.serving.validate import (
    InvalidRequest,
    check_keyed,
    check_limits,
    check_prompt_tokens,
    check_request,
)


def nested(depth: int, inner: str = "1") -> bytes:
    return ('{"prompt": "x", "extra": ' + "[" * depth + inner + "]" * depth + "}").encode()


def test_nesting_within_the_limit_decodes() -> None:
    assert decode_body(nested(31), max_depth=32)["prompt"] == "x"  # 31 + the object = 32


@pytest.mark.parametrize("depth", [32, 33, 500, 100_000])
def test_nesting_past_the_limit_is_a_400(depth: int) -> None:
    with pytest.raises(ApiError) as err:
        decode_body(nested(depth), max_depth=32)
    assert err.value.status == 400
    assert "deeper than 32" in err.value.message


def test_brackets_inside_strings_and_escapes_do_not_count() -> None:
    text = '[[[[{{{{ \\" ]]]] \\\\'
    body = json.dumps({"prompt": text * 50, "s": ['a\\"[[['] * 40}).encode()
    assert decode_body(body, max_depth=3)["prompt"] == text * 50


def test_msgspec_recursion_is_a_400_even_with_a_high_limit() -> None:
    with pytest.raises(ApiError) as err:
        decode_body(nested(5_000), max_depth=256)
    assert err.value.status == 400


@pytest.mark.parametrize(
    "body",
    [b"", b"[]", b"null", b"\xff\xfe{}", b'{"prompt": "\xc3\x28"}', b"{" * 10, b'{"a":1}x'],
)
def test_bodies_that_are_not_json_objects_are_400(body: bytes) -> None:
    with pytest.raises(ApiError) as err:
        decode_body(body)
    assert err.value.status == 400


def test_limits_on_n_max_tokens_and_batch_size() -> None:
    limits = LimitsConfig(max_n=4, max_output_tokens=100, max_prompts=2)
    check_limits(parse_completion({"prompt": "a", "n": 4, "max_tokens": 100}), limits)
    for payload, param in [
        ({"prompt": "a", "n": 5}, "n"),
        ({"prompt": "a", "max_tokens": 101}, "max_tokens"),
        ({"prompt": ["a", "b", "c"]}, "prompt"),
        ({"prompt": [[1], [2], [3]]}, "prompt"),
    ]:
        with pytest.raises(ApiError) as err:
            check_limits(parse_completion(payload), limits)
        assert (err.value.status, err.value.param) == (400, param)
    with pytest.raises(ApiError) as err:
        check_limits(parse_chat({"messages": [{"role": "user"}] * 3}), limits)
    assert err.value.param == "messages"
    with pytest.raises(ApiError) as err:
        check_limits(
            parse_chat({"messages": [{"role": "user"}], "max_completion_tokens": 10**9}), limits
        )
    assert err.value.param == "max_completion_tokens"


def test_max_completion_tokens_is_checked_even_beside_a_small_max_tokens() -> None:
    limits = LimitsConfig(max_output_tokens=100)
    chat = {"messages": [{"role": "user"}], "max_tokens": 1, "max_completion_tokens": 2_000_000}
    with pytest.raises(ApiError) as err:
        check_limits(parse_chat(chat), limits)
    assert (err.value.status, err.value.param) == (400, "max_completion_tokens")
    assert "at most 100" in err.value.message
    chat = {"messages": [{"role": "user"}], "max_tokens": 2_000_000, "max_completion_tokens": 1}
    with pytest.raises(ApiError) as err:
        check_limits(parse_chat(chat), limits)
    assert err.value.param == "max_tokens"


def test_max_completion_tokens_takes_precedence_on_chat_as_in_vllm() -> None:
    chat = {"messages": [{"role": "user"}], "max_tokens": 1, "max_completion_tokens": 90}
    assert parse_chat(chat).output_tokens == 90
    assert parse_chat({"messages": [{"role": "user"}], "max_tokens": 7}).output_tokens == 7
    assert parse_chat({"messages": [{"role": "user"}]}).output_tokens is None
    # the completions API has no max_completion_tokens: vLLM reads max_tokens only
    assert parse_completion({"prompt": "a", "max_completion_tokens": 90}).output_tokens is None


def test_prompts_times_n_is_bounded_by_max_sequences() -> None:
    limits = LimitsConfig(max_sequences=64)
    check_limits(parse_completion({"prompt": ["a"] * 8, "n": 8}), limits)
    check_limits(parse_chat({"messages": [{"role": "user"}] * 100, "n": 64}), limits)
    for payload in ({"prompt": ["a"] * 8, "n": 9}, {"prompt": [[1]] * 65}):
        with pytest.raises(ApiError) as err:
            check_limits(parse_completion(payload), limits)
        assert (err.value.status, err.value.param) == (400, "n")
        assert "at most 64" in err.value.message
    with pytest.raises(ApiError):
        check_limits(parse_chat({"messages": [{"role": "user"}], "n": 65}), limits)


def test_the_default_limits_refuse_the_131072_sequence_request() -> None:
    with pytest.raises(ApiError) as err:
        check_limits(parse_completion({"prompt": ["a"] * 1_024, "n": 128}), LimitsConfig())
    assert "131072 sequences" in err.value.message


def test_prompt_token_limit_names_the_count() -> None:
    parsed = parse_completion({"prompt": [1, 2, 3]})
    parsed.prompts = [[1, 2, 3]]
    check_prompt_tokens(parsed, LimitsConfig(max_prompt_tokens=3))
    with pytest.raises(ApiError) as err:
        check_prompt_tokens(parsed, LimitsConfig(max_prompt_tokens=2))
    assert err.value.status == 400
    assert err.value.code == "context_length_exceeded"
    assert "3 tokens" in err.value.message


def test_each_refusal_names_the_limit_it_broke() -> None:
    limits = LimitsConfig(max_n=2, max_prompts=2, max_sequences=3, max_output_tokens=16)
    for payload, reason in [
        ({"prompt": "a", "n": 3}, "max_n"),
        ({"prompt": "a", "max_tokens": 17}, "max_output_tokens"),
        ({"prompt": ["a", "b", "c"]}, "max_prompts"),
        ({"prompt": ["a", "b"], "n": 2}, "max_sequences"),
        ({"prompt": "a", "model": "nope"}, "model_not_found"),
        ({"prompt": "a"}, "model_required"),
    ]:
        with pytest.raises(InvalidRequest) as err:
            check_request(parse_completion(payload), limits, ["m", "m-adapter"])
        assert err.value.reason == reason, payload
    parsed = parse_completion({"prompt": [1, 2, 3]})
    parsed.prompts = [[1, 2, 3]]
    with pytest.raises(InvalidRequest) as err:
        check_prompt_tokens(parsed, LimitsConfig(max_prompt_tokens=2))
    assert err.value.reason == "max_prompt_tokens"


def test_check_request_returns_the_model_to_route_for() -> None:
    limits = LimitsConfig()
    assert check_request(parse_completion({"prompt": "a"}), limits, ["m"]) == "m"
    chosen = parse_completion({"prompt": "a", "model": "m-adapter"})
    assert check_request(chosen, limits, ["m", "m-adapter"]) == "m-adapter"


def test_no_served_model_yet_is_a_503_not_a_refusal() -> None:
    with pytest.raises(ApiError) as err:
        check_request(parse_completion({"prompt": "a"}), LimitsConfig(), [])
    assert err.value.status == 503 and not isinstance(err.value, InvalidRequest)


def test_block_keys_get_the_same_bounds_and_messages() -> None:
    limits = LimitsConfig(max_n=2, max_sequences=3, max_output_tokens=16, max_prompt_tokens=8)
    check_keyed(2, 16, 8, limits)
    check_keyed(1, None, 8, limits)
    for args, reason, message in [
        ((3, None, 8), "max_n", "'n' must be at most 2"),
        ((1, 17, 8), "max_output_tokens", "'max_tokens' must be at most 16"),
        ((1, None, 9), "max_prompt_tokens", "the prompt has 9 tokens"),
    ]:
        with pytest.raises(InvalidRequest) as err:
            check_keyed(*args, limits)
        assert err.value.reason == reason and message in err.value.message
    with pytest.raises(InvalidRequest) as err:
        check_keyed(3, None, 8, LimitsConfig(max_n=4, max_sequences=2))
    assert err.value.reason == "max_sequences"


CHAT = [{"role": "user", "content": "x"}]
OUTPUT_BOUNDS = [
    # (parser, body, param, message): each API's output bound, what vLLM 0.32 refuses.
    (parse_completion, {"prompt": "x", "max_tokens": 0}, "'max_tokens' must be at least 1, got 0"),
    (parse_completion, {"prompt": "x", "max_tokens": -1, "echo": True}, "at least 0, got -1"),
    (parse_completion, {"prompt": "x", "max_tokens": 1.5}, "'max_tokens' must be an integer"),
    (parse_chat, {"messages": CHAT, "max_tokens": 0}, "'max_tokens' must be at least 1, got 0"),
    (
        parse_chat,
        {"messages": CHAT, "max_completion_tokens": 0},
        "'max_completion_tokens' must be at least 1, got 0",
    ),
    (
        parse_responses,
        {"input": "x", "max_output_tokens": 0},
        "'max_output_tokens' must be at least 1, got 0",
    ),
    (
        parse_responses,
        {"input": "x", "max_output_tokens": "ten"},
        "'max_output_tokens' must be an integer",
    ),
    (
        parse_messages,
        {"model": "m", "messages": CHAT, "max_tokens": -1},
        "'max_tokens' must be at least 1, got -1",
    ),
    (
        parse_messages,
        {"model": "m", "messages": CHAT, "max_tokens": "ten"},
        "'max_tokens' must be an integer",
    ),
    (parse_messages, {"model": "m", "messages": CHAT}, "'max_tokens' is required"),
]


@pytest.mark.parametrize(("parse", "body", "message"), OUTPUT_BOUNDS)
def test_each_api_says_what_is_wrong_with_its_output_bound(
    parse: Callable[[dict[str, Any]], ParsedRequest], body: dict[str, Any], message: str
) -> None:
    with pytest.raises(ApiError) as refused:
        parse(body)
    assert refused.value.status == 400
    assert message in refused.value.message


def test_a_completion_may_echo_its_prompt_alone() -> None:
    assert parse_completion({"prompt": "x", "max_tokens": 0, "echo": True}).max_tokens == 0


def test_a_keyed_pick_has_the_same_output_bound() -> None:
    with pytest.raises(ApiError) as refused:
        check_keyed(1, 0, 16, LimitsConfig())
    assert refused.value.message == "'max_tokens' must be at least 1, got 0"
