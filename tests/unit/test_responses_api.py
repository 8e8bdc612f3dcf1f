"""The Responses API's pure parts: input items as chat messages, the id watch on an
engine's stream, the response store's TTL and bound, and the engine tokenizer's
renderer with its fallback."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.config import ResponsesConfig
from router.frontends.http.responses_api import ResponseIdWatch, parse_responses
from router.response_store import ResponseStore
from router.serving.errors import ApiError
from router.serving.relay import ends_stream
from router.tokenization.modes import EngineTokenizer
from router.tokenization.responses_input import (
    InvalidInput,
    chat_tools,
    output_messages,
    responses_messages,
)


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    assert responses_messages("be brief", "hi") == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]


def test_input_items_become_chat_messages_as_vllm_builds_them() -> None:
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "x"}, {"type": "text", "text": "y"}],
        },
    ]
    assert responses_messages(None, items) == [
        {"role": "user", "content": "a"},
        {
            "role": "assistant",
            "reasoning": "think",
            "content": "b",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "user", "content": "x\ny"},
    ]


def test_image_parts_are_kept_beside_text_parts() -> None:
    image = {"type": "input_image", "image_url": "data:image/png;base64,AA"}
    item = {"role": "user", "content": [{"type": "input_text", "text": "what"}, image]}
    assert responses_messages(None, [item])[0]["content"] == [
        {"type": "text", "text": "what"},
        image,
    ]


def test_a_continued_conversation_drops_the_old_instructions() -> None:
    history = [{"role": "system", "content": "old"}, {"role": "user", "content": "q"}]
    history += output_messages(
        [{"type": "message", "content": [{"type": "output_text", "text": "a"}]}]
    )
    assert responses_messages("new", "q2", history) == [
        {"role": "system", "content": "new"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "q2"},
    ]


def test_unknown_items_are_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="mystery"):
        responses_messages(None, [{"type": "mystery"}])


def test_function_tools_take_the_chat_form() -> None:
    tools = [{"type": "function", "name": "f", "parameters": {}}, {"type": "web_search"}]
    assert chat_tools(tools) == [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert chat_tools([]) is None


def test_parse_keeps_what_rendering_reads_and_the_output_bound() -> None:
    parsed = parse_responses(
        {
            "input": "hi",
            "instructions": "s",
            "max_output_tokens": 7,
            "previous_response_id": "resp_1",
            "store": True,
            "temperature": 0.5,
        }
    )
    assert parsed.responses == {"input": "hi", "instructions": "s"}
    assert parsed.output_tokens == 7 and parsed.previous_response_id == "resp_1"
    with pytest.raises(ApiError) as err:
        parse_responses({"input": "hi", "max_output_tokens": 0})
    assert err.value.param == "max_output_tokens"


# ---------------------------------------------------------------------------- the store


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_the_store_forgets_ids_after_their_ttl() -> None:
    clock = Clock()
    store = ResponseStore(ResponsesConfig(ttl_s=10), clock=clock)
    await store.remember("resp_a", "127.0.0.1:1")
    clock.now = 9.9
    assert await store.engine_of("resp_a") == "127.0.0.1:1"
    clock.now = 10.1
    assert await store.engine_of("resp_a") is None
    assert len(store) == 0


async def test_the_store_keeps_at_most_its_bound_oldest_forgotten_first() -> None:
    store = ResponseStore(ResponsesConfig(max_remembered=2))
    for i in range(3):
        await store.remember(f"resp_{i}", f"127.0.0.1:{i}")
    assert [await store.engine_of(f"resp_{i}") for i in range(3)] == [
        None,
        "127.0.0.1:1",
        "127.0.0.1:2",
    ]


async def test_the_store_ignores_ids_that_are_not_ids() -> None:
    store = ResponseStore(ResponsesConfig())
    await store.remember("../admin", "127.0.0.1:1")
    assert len(store) == 0 and await store.engine_of("../admin") is None


# ---------------------------------------------------------------------------- the id watch


def _event(kind: str, response_id: str) -> bytes:
    data = msgspec.json.encode({"response": {"id": response_id}, "type": kind})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


async def test_the_watch_learns_a_stream_id_split_across_chunks() -> None:
    store = ResponseStore(ResponsesConfig())
    watch = ResponseIdWatch(store, "127.0.0.1:9")
    raw = _event("response.created", "resp_split")
    await watch.chunk(raw[:20])
    assert not watch.learned
    await watch.chunk(raw[20:])
    assert watch.learned and await store.engine_of("resp_split") == "127.0.0.1:9"


async def test_the_watch_learns_a_json_answer_and_nothing_else() -> None:
    store = ResponseStore(ResponsesConfig())
    watch = ResponseIdWatch(store, "127.0.0.1:9")
    await watch.answer(b'{"id": "chatcmpl-1", "object": "chat.completion"}')
    assert len(store) == 0
    await watch.answer(b'{"id": "resp_json", "object": "response"}')
    assert await store.engine_of("resp_json") == "127.0.0.1:9"


# ---------------------------------------------------------------------------- engine mode


class Engine:
    """What an engine answers the tokenizer's calls, by path (the calls are recorded)."""

    def __init__(self, answers: dict[str, tuple[int, Any]]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        self.calls.append((path, msgspec.json.decode(body)))
        status, answer = self.answers[path]
        return status, msgspec.json.encode(answer)


MESSAGES = [{"role": "user", "content": "hi"}]


async def test_engine_mode_uses_the_engines_responses_renderer() -> None:
    engine = Engine({"/v1/responses/render": (200, {"token_ids": [1, 2, 3]})})
    tokenizer = EngineTokenizer("m", engine.post)
    assert await tokenizer.responses({"input": "hi"}, MESSAGES) == [1, 2, 3]
    assert engine.calls == [("/v1/responses/render", {"input": "hi", "model": "m"})]


async def test_without_a_renderer_engine_mode_tokenizes_the_chat_with_special_tokens() -> None:
    engine = Engine(
        {
            "/v1/responses/render": (403, {"error": {"message": "disabled"}}),
            "/tokenize": (200, {"tokens": [1, 1, 5]}),
        }
    )
    tokenizer = EngineTokenizer("m", engine.post)
    tools = [{"type": "function", "name": "f"}]
    assert await tokenizer.responses({"input": "hi", "tools": tools}, MESSAGES) == [1, 1, 5]
    assert await tokenizer.responses({"input": "hi"}, MESSAGES) == [1, 1, 5]
    paths = [path for path, _ in engine.calls]
    # The renderer is asked once; its refusal is remembered.
    assert paths == ["/v1/responses/render", "/tokenize", "/tokenize"]
    sent = engine.calls[1][1]
    assert sent["add_special_tokens"] is True and sent["messages"] == MESSAGES
    assert sent["tools"] == [{"type": "function", "function": {"name": "f"}}]


@pytest.mark.parametrize(
    "last",
    [
        b'event: response.completed\ndata: {"type":"response.completed"}',
        # OpenAI's own end of a stream cut by max_output_tokens (vLLM 0.32 sends the
        # one above, with the response's status "incomplete"), and of a failed one.
        b'event: response.incomplete\ndata: {"type":"response.incomplete"}',
        b'event: response.failed\ndata: {"type":"response.failed"}',
    ],
)
def test_the_relay_sees_every_last_event_of_a_responses_stream(last: bytes) -> None:
    """The request leaves the engine's load when the engine sends it (before the client
    reads it), wherever the chunks split it."""
    before = b'event: response.output_text.delta\ndata: {"delta":"hi"}\n\n'
    stream = before + last + b"\n\n"
    for cut in range(len(before), len(stream)):
        head, chunk = stream[:cut], stream[cut:]
        assert ends_stream(b"\n", head) or ends_stream(head, chunk), cut
    assert not ends_stream(b"\n", before)
