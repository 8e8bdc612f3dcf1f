"""Intake, table-driven: every refusal of a request's body, and the requests at the
limits that pass, decided once, without a transport.

Each front end hands intake the body it read (:mod:`router.serving.owned` decodes it and
takes out the router-owned fields; :func:`router.serving.intake.prepare` parses, checks,
tokenizes and hashes it; :func:`support.intake.intake` takes the same steps). What a
front end adds is only the form of the refusal: one error-mapping test each, in
``test_front_ends_refuse_alike.py``. A router with limits small enough to reach, on the
shared emulated engine (it serves ``kvroute-emulated`` and the LoRA adapter
``sql-adapter``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from support.intake import intake, refusal
from support.routers import start_router

from router.app import RouterApp
from router.emulator import EmulatedEngine
from router.serving.errors import ApiError

LIMITS = {
    "max_n": 2,
    "max_prompts": 2,
    "max_sequences": 3,
    "max_prompt_tokens": 8,
    "max_output_tokens": 16,
    "max_json_depth": 4,
}
MODEL = "kvroute-emulated"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def raw(payload: dict[str, Any] | list[Any]) -> bytes:
    return json.dumps(payload).encode()


#: (case, endpoint, body, status, param, what the message says)
REFUSED: list[tuple[str, str, bytes, int, str | None, str]] = [
    # the body itself
    ("not JSON", "completions", b"{not json", 400, None, "request body is not valid JSON"),
    ("a JSON array", "completions", b"[1, 2]", 400, None, "request body must be a JSON object"),
    (
        "JSON over max_json_depth",
        "completions",
        raw({"model": MODEL, "prompt": "x", "extra": [[[[1]]]]}),
        400,
        None,
        "nests JSON deeper than 4 levels",
    ),
    # what routing cannot read
    ("no prompt", "completions", raw({"max_tokens": 2}), 400, "prompt", "'prompt'"),
    ("an empty prompt", "completions", raw({"prompt": ""}), 400, "prompt", "prompt"),
    (
        "a negative token id",
        "completions",
        raw({"prompt": [1, -5]}),
        400,
        "prompt",
        "token ids must be",
    ),
    (
        "a token id past 2^32",
        "completions",
        raw({"prompt": [1, 2**40]}),
        400,
        "prompt",
        "[0, 2^32)",
    ),
    ("a number for a prompt", "completions", raw({"prompt": 7}), 400, "prompt", "prompt"),
    (
        "max_tokens not an integer",
        "chat",
        raw({**CHAT, "max_tokens": "ten"}),
        400,
        "max_tokens",
        "'max_tokens' must be an integer",
    ),
    (
        "stream not a boolean",
        "completions",
        raw({"prompt": "a", "stream": "yes"}),
        400,
        "stream",
        "stream",
    ),
    ("n of 0", "completions", raw({"prompt": "a", "n": 0}), 400, "n", "'n'"),
    ("no messages", "chat", raw({"messages": []}), 400, "messages", "messages"),
    (
        "a message with no role",
        "chat",
        raw({"messages": [{"content": "x"}]}),
        400,
        "messages",
        "role",
    ),
    (
        "a role no engine knows",
        "chat",
        raw({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}),
        400,
        "messages",
        "wizard",
    ),
    ("messages as a string", "chat", raw({"messages": "hi"}), 400, "messages", "messages"),
    # the limits
    (
        "n over max_n",
        "completions",
        raw({"model": MODEL, "prompt": "x", "n": 3}),
        400,
        "n",
        "'n' must be at most 2",
    ),
    (
        "too many prompts",
        "completions",
        raw({"model": MODEL, "prompt": ["a", "b", "c"]}),
        400,
        "prompt",
        "at most 2 prompts per request, got 3",
    ),
    (
        "too many messages",
        "chat",
        raw({**CHAT, "messages": CHAT["messages"] * 3}),
        400,
        "messages",
        "at most 2 messages per request, got 3",
    ),
    (
        "prompts x n over max_sequences",
        "completions",
        raw({"model": MODEL, "prompt": ["a", "b"], "n": 2}),
        400,
        "n",
        "this request asks for 4 sequences",
    ),
    (
        "prompt over max_prompt_tokens",
        "completions",
        raw({"model": MODEL, "prompt": "w0 w1 w2 w3 w4 w5 w6 w7 w8"}),
        400,
        "prompt",
        "the prompt has 9 tokens; this router accepts at most 8",
    ),
    (
        "token ids over max_prompt_tokens",
        "completions",
        raw({"model": MODEL, "prompt": list(range(9))}),
        400,
        "prompt",
        "the prompt has 9 tokens",
    ),
    (
        "max_tokens over max_output_tokens",
        "completions",
        raw({"model": MODEL, "prompt": "x", "max_tokens": 17}),
        400,
        "max_tokens",
        "'max_tokens' must be at most 16",
    ),
    (
        "max_completion_tokens over max_output_tokens",
        "chat",
        raw({**CHAT, "max_completion_tokens": 17}),
        400,
        "max_completion_tokens",
        "'max_completion_tokens' must be at most 16",
    ),
    (
        "max_tokens under the least an engine runs",
        "completions",
        raw({"model": MODEL, "prompt": "x", "max_tokens": 0}),
        400,
        "max_tokens",
        "'max_tokens' must be at least 1, got 0",
    ),
    (
        "max_completion_tokens under the least an engine runs",
        "chat",
        raw({**CHAT, "max_tokens": 5, "max_completion_tokens": 0}),
        400,
        "max_completion_tokens",
        "'max_completion_tokens' must be at least 1, got 0",
    ),
    # the model
    ("unknown model", "completions", raw({"prompt": "x", "model": "nope"}), 404, "model", "'nope'"),
    (
        "unknown LoRA adapter",
        "completions",
        raw({"prompt": "x", "model": "sql-adapter-2"}),
        404,
        "model",
        "The model 'sql-adapter-2' does not exist",
    ),
    (
        "no model while several are served",
        "chat",
        raw({"messages": CHAT["messages"]}),
        400,
        "model",
        "'model' is required when several models are served",
    ),
]

#: (case, endpoint, body): at the limits, and passed.
ACCEPTED: list[tuple[str, str, bytes]] = [
    (
        "at every bound",
        "completions",
        raw({"model": MODEL, "prompt": "w0 w1 w2 w3 w4 w5 w6 w7", "max_tokens": 16, "n": 1}),
    ),
    ("two prompts", "completions", raw({"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2})),
    ("eight token ids", "completions", raw({"model": MODEL, "prompt": list(range(8))})),
    (
        "chat at its bounds",
        "chat",
        raw({**CHAT, "messages": CHAT["messages"] * 2, "max_completion_tokens": 16, "n": 2}),
    ),
    ("a served LoRA adapter", "completions", raw({"model": "sql-adapter", "prompt": "x"})),
    (
        "the prompt echoed alone",
        "completions",
        raw({"model": MODEL, "prompt": "x", "max_tokens": 0, "echo": True}),
    ),
    (
        "router-owned fields, taken out",
        "completions",
        raw({"model": MODEL, "prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}}),
    ),
]


@pytest_asyncio.fixture(scope="module")
async def router(shared_engine: EmulatedEngine) -> AsyncIterator[RouterApp]:
    app = await start_router([shared_engine.url], limits=LIMITS)
    yield app
    await app.stop()


@pytest.mark.parametrize(
    ("endpoint", "body", "status", "param", "needle"),
    [case[1:] for case in REFUSED],
    ids=[case[0] for case in REFUSED],
)
async def test_intake_refuses_it(
    router: RouterApp, endpoint: str, body: bytes, status: int, param: str | None, needle: str
) -> None:
    err = await refusal(router, endpoint, body)
    assert (err.status, err.param) == (status, param), err
    assert needle in err.message, err.message
    assert router.loads.in_flight == 0


@pytest.mark.parametrize(
    ("endpoint", "body"), [case[1:] for case in ACCEPTED], ids=[case[0] for case in ACCEPTED]
)
async def test_intake_accepts_it(router: RouterApp, endpoint: str, body: bytes) -> None:
    forwarded, ready = await intake(router, endpoint, body)
    assert ready.model in {MODEL, "sql-adapter"}
    assert ready.route.prompt_tokens >= 1
    assert b"kv_transfer_params" not in forwarded
    assert router.loads.in_flight == 0  # intake charges no engine


async def test_trusted_clients_keep_their_handoff_fields(shared_engine: EmulatedEngine) -> None:
    app = await start_router([shared_engine.url], auth={"allow_client_handoff_fields": True})
    try:
        body = raw({"model": MODEL, "prompt": "x", "kv_transfer_params": {"a": 1}})
        forwarded, _ = await intake(app, "completions", body)
        assert forwarded == body
        owned = app.services.owned
        payload = {"kv_transfer_params": {}}
        owned.refuse(payload)  # trusted: no refusal either
        assert payload == {"kv_transfer_params": {}}
    finally:
        await app.stop()


async def test_a_body_the_router_cannot_change_is_refused_naming_the_field(
    router: RouterApp,
) -> None:
    payload = {"prompt": "x", "bootstrap_room": 7, "vllm_xargs": {"kv_transfer_params": {}}}
    with pytest.raises(ApiError) as caught:
        router.services.owned.refuse(payload, "remove them")
    err = caught.value
    assert (err.status, err.param) == (400, "bootstrap_room")
    assert err.message == (
        "the router sets bootstrap_room, vllm_xargs.kv_transfer_params itself; remove them"
    )
    assert "vllm_xargs" in payload  # refusing changes nothing
