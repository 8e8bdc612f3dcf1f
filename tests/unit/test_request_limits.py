"""Request limits and hostile bodies: every one a 400 in OpenAI's form, never a crash."""

from __future__ import annotations

import json

import pytest

from router.api.errors import ApiError
from router.api.openai import (
    check_limits,
    check_prompt_tokens,
    decode_body,
    parse_chat,
    parse_completion,
)
from router.config import LimitsConfig


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
    assert err.value.param == "max_tokens"


def test_prompt_token_limit_names_the_count() -> None:
    parsed = parse_completion({"prompt": [1, 2, 3]})
    parsed.prompts = [[1, 2, 3]]
    check_prompt_tokens(parsed, LimitsConfig(max_prompt_tokens=3))
    with pytest.raises(ApiError) as err:
        check_prompt_tokens(parsed, LimitsConfig(max_prompt_tokens=2))
    assert err.value.status == 400
    assert err.value.code == "context_length_exceeded"
    assert "3 tokens" in err.value.message
