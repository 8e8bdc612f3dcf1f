"""Anthropic Messages as chat messages (vLLM 0.32's conversion), the Anthropic error
shape by route, and ``x-api-key`` as a client key."""

from __future__ import annotations

import json

import pytest

from router.config import AuthConfig
from router.frontends.http.anthropic import parse_messages
from router.security import AuthError, Credentials
from router.serving.errors import ApiError, anthropic_route, shape_for
from router.serving.usage import engine_input_tokens, stream_input_tokens
from router.tokenization.anthropic import chat_messages


def test_system_blocks_join_and_the_billing_header_is_dropped() -> None:
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
        {"type": "text", "text": "You help. "},
        {"type": "text", "text": "Briefly."},
    ]
    assert chat_messages(system, [{"role": "user", "content": "hi"}]) == [
        {"role": "system", "content": "You help. Briefly."},
        {"role": "user", "content": "hi"},
    ]


def test_an_inline_system_message_stays_or_merges_as_the_template_needs() -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "system", "content": [{"type": "text", "text": "reminder"}]},
        {"role": "user", "content": "b"},
    ]
    assert chat_messages("top. ", messages) == [
        {"role": "system", "content": "top. "},
        {"role": "user", "content": "a"},
        {"role": "system", "content": "reminder"},
        {"role": "user", "content": "b"},
    ]
    assert chat_messages("top. ", messages, merge_inline_system=True) == [
        {"role": "system", "content": "top. reminder"},
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
    ]


def test_blocks_become_parts_reasoning_tool_calls_and_tool_messages() -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image", "source": {"type": "url", "url": "https://x/i.png"}},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"q": 1}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "42"}],
        },
    ]
    assert chat_messages(None, messages) == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "https://x/i.png"}},
            ],
        },
        {
            "role": "assistant",
            "reasoning": "hmm",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"q": 1}'}}
            ],
            "content": "calling",
        },
        # The tool result's user message has no content left: dropped, as vLLM does.
        {"role": "tool", "tool_call_id": "t1", "content": "42"},
    ]


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}, "model"),
        ({"model": "m", "max_tokens": 1, "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (
            {"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]},
            "max_tokens",
        ),
        ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": 3}]}, "messages"),
        (
            {
                "model": "m",
                "max_tokens": 1,
                "system": 3,
                "messages": [{"role": "user", "content": "x"}],
            },
            "system",
        ),
    ],
)
def test_parse_refuses_what_routing_cannot_read(payload: dict[str, object], param: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse_messages(payload)
    assert (refused.value.status, refused.value.param) == (400, param)


def test_parse_reads_the_routing_facts() -> None:
    parsed = parse_messages(
        {
            "model": "m",
            "max_tokens": 7,
            "stream": True,
            "cache_salt": "salt",
            "metadata": {"user_id": "u-1"},
            "system": "s",
            "messages": [{"role": "user", "content": "x"}],
        }
    )
    assert (parsed.model, parsed.max_tokens, parsed.stream, parsed.n) == ("m", 7, True, 1)
    assert (parsed.cache_salt, parsed.user, parsed.include_usage) == ("salt", "u-1", False)
    assert parsed.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}]


def test_the_engines_prompt_is_input_plus_cached_tokens() -> None:
    usage = {"input_tokens": 26, "output_tokens": 3, "cache_creation_input_tokens": 32}
    assert engine_input_tokens({**usage, "cache_read_input_tokens": 0}) == 58
    assert engine_input_tokens({"output_tokens": 3}) is None
    start = (
        b'event: message_start\ndata: {"type":"message_start","message":{"id":"m",'
        b'"usage":{"input_tokens":58,"output_tokens":0}}}\n\n'
    )
    assert stream_input_tokens(start) == 58
    assert stream_input_tokens(b'event: ping\ndata: {"type":"ping"}\n\n') is None


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (429, "rate_limit_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
    ],
)
def test_errors_on_the_messages_routes_take_anthropics_shape(status: int, kind: str) -> None:
    err = ApiError(status, "no", param="model")
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = json.loads(shape_for(path).body(err))
        assert body == {"type": "error", "error": {"type": kind, "message": "no"}}
        event = shape_for(path).sse(err)
        assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n")
    assert json.loads(shape_for("/v1/chat/completions").body(err))["error"]["param"] == "model"
    assert not anthropic_route("/v1/messagesx") and anthropic_route("/v1/messages")


@pytest.mark.parametrize(
    ("setting", "messages", "chat"),
    [("anthropic", True, False), ("all", True, True), ("off", False, False)],
)
def test_x_api_key_counts_where_the_setting_says(setting: str, messages: bool, chat: bool) -> None:
    creds = Credentials(AuthConfig(api_keys=["k"], accept_x_api_key=setting))

    def accepted(path: str) -> bool:
        try:
            creds.check_http({"x-api-key": "k"}, path)
        except AuthError:
            return False
        return True

    assert accepted("/v1/messages") is messages
    assert accepted("/v1/chat/completions") is chat
    with pytest.raises(AuthError):  # Authorization wins when both are sent
        creds.check_http({"authorization": "Bearer wrong", "x-api-key": "k"}, "/v1/messages")


def test_only_pass_sends_an_x_api_key_on_and_as_bearer() -> None:
    passing = Credentials(AuthConfig(upstream="pass"))
    assert passing.upstream_authorization(None, "k") == "Bearer k"
    assert passing.upstream_authorization("Bearer c", "k") == "Bearer c"
    assert Credentials(AuthConfig(upstream="drop")).upstream_authorization(None, "k") is None
    token = Credentials(AuthConfig(upstream="token", upstream_token="engine"))
    assert token.upstream_authorization(None, "k") == "Bearer engine"
