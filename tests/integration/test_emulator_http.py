"""The emulator's OpenAI-compatible API over real HTTP on loopback."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from support.clients import get, metric, metrics, post, stream
from support.engines import poll, start_test_engine
from support.listeners import DialCounter, hostile_handoff

from router.emulator import EmulatedEngine
from router.tokenization import WordTokenizer

WORDS = WordTokenizer()


def text_prompt(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


async def complete(
    http: aiohttp.ClientSession, engine: EmulatedEngine, **body: Any
) -> dict[str, Any]:
    status, answer = await post(http, f"{engine.url}/v1/completions", {"max_tokens": 2, **body})
    assert status == 200, answer
    return answer


async def test_a_repeated_2000_token_prompt_reports_0_then_1984_cached_tokens(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    prompt = text_prompt(2_000)
    first = await complete(http, engine, prompt=prompt)
    second = await complete(http, engine, prompt=prompt)
    assert first["usage"]["prompt_tokens"] == 2_000
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 1_984}


async def test_different_prompts_miss_and_a_shared_prefix_hits_whole_blocks(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    await complete(http, engine, prompt=text_prompt(100, "a"))
    other = await complete(http, engine, prompt=text_prompt(100, "b"))
    shared = await complete(http, engine, prompt=text_prompt(40, "a") + " " + text_prompt(60, "c"))
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert shared["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


async def test_token_id_prompts_hit_the_same_blocks_as_their_text(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    text = text_prompt(300)
    await complete(http, engine, prompt=text)
    by_ids = await complete(http, engine, prompt=WORDS.encode(text))
    assert by_ids["usage"]["prompt_tokens_details"]["cached_tokens"] == 288


async def test_a_chat_follow_up_reuses_the_previous_answer(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    messages = [{"role": "user", "content": text_prompt(60)}]
    status, first = await post(
        http, f"{engine.url}/v1/chat/completions", {"messages": messages, "max_tokens": 40}
    )
    assert status == 200
    answer = first["choices"][0]["message"]["content"]
    assert len(answer.split()) == 40 and first["choices"][0]["finish_reason"] == "length"
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
    status, second = await post(
        http, f"{engine.url}/v1/chat/completions", {"messages": messages, "max_tokens": 1}
    )
    # Turn 1 computed its prompt (<|user|> + 60 words + <|end|> + <|assistant|> = 63
    # tokens) and its answer but the last token: 102 tokens, 6 whole blocks.
    assert first["usage"]["prompt_tokens"] == 63
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 96


async def test_the_same_prompt_gets_the_same_answer(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    a = await complete(http, engine, prompt="tell me", max_tokens=8)
    b = await complete(http, engine, prompt="tell me", max_tokens=8)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert len(a["choices"][0]["text"].split()) == 8


async def test_a_prompt_list_with_n_choices(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    answer = await complete(http, engine, prompt=["one two three", [1100, 1101]], n=2)
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in answer["choices"]]
    assert texts[0] != texts[1] and all(len(t.split()) == 2 for t in texts)
    assert answer["usage"]["prompt_tokens"] == 5
    assert answer["usage"]["completion_tokens"] == 8


async def test_echo_prepends_the_prompt(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    answer = await complete(http, engine, prompt="hello there", echo=True)
    assert answer["choices"][0]["text"].startswith("hello there ")


async def test_echo_with_max_tokens_0_answers_the_prompt_alone_as_vllm(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    answer = await complete(http, engine, prompt="hello there", echo=True, max_tokens=0)
    assert answer["choices"][0]["text"] == "hello there"
    assert answer["usage"]["completion_tokens"] == 1  # vLLM runs one step and drops it
    status, refused = await post(
        http, f"{engine.url}/v1/completions", {"prompt": "x", "max_tokens": 0}
    )
    assert status == 400 and refused["error"]["param"] == "max_tokens"


async def test_streaming_completion_ends_with_a_usage_chunk_and_done(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    body = {
        "prompt": text_prompt(50),
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = await stream(http, f"{engine.url}/v1/completions", body)
    *chunks, usage, done = events
    assert done == "[DONE]"
    assert len(chunks) == 5 and all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert len(text.split()) == 5
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 5 and usage["usage"]["prompt_tokens"] == 50
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_streaming_chat_sends_the_role_first(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    events = await stream(http, f"{engine.url}/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert len("".join(d["content"] for d in deltas).split()) == 3
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert all("usage" not in e for e in events[:-1])


async def test_the_request_id_header_is_echoed_and_names_the_response(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    async with http.post(
        f"{engine.url}/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "req-42"}
    ) as resp:
        assert resp.headers["x-request-id"] == "req-42"
        assert (await resp.json())["id"] == "cmpl-req-42"


async def test_tokenize_and_detokenize_match_the_shared_tokenizer(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    status, tok = await post(
        http, f"{engine.url}/tokenize", {"prompt": "a b c", "return_token_strs": True}
    )
    assert status == 200
    assert tok["tokens"] == WORDS.encode("a b c") and tok["count"] == 3
    assert tok["token_strs"] == ["a", "b", "c"] and tok["max_model_len"] == 16_384
    messages = [{"role": "user", "content": "hi"}]
    _, chat = await post(http, f"{engine.url}/tokenize", {"messages": messages})
    assert chat["tokens"] == WORDS.encode(WORDS.apply_chat_template(messages))
    _, detok = await post(http, f"{engine.url}/detokenize", {"tokens": tok["tokens"]})
    assert detok == {"prompt": "a b c"}


async def test_render_endpoints_return_token_ids_like_vllm(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    status, rendered = await post(
        http, f"{engine.url}/v1/completions/render", {"prompt": ["a b", "c"], "temperature": 0.5}
    )
    assert status == 200
    assert [r["token_ids"] for r in rendered] == [WORDS.encode("a b"), WORDS.encode("c")]
    assert rendered[0]["request_id"].startswith("cmpl-")
    assert rendered[0]["sampling_params"]["temperature"] == 0.5
    messages = [{"role": "user", "content": "hi"}]
    status, chat = await post(
        http, f"{engine.url}/v1/chat/completions/render", {"messages": messages}
    )
    assert status == 200 and chat["request_id"].startswith("chatcmpl-")
    assert chat["token_ids"] == WORDS.encode(WORDS.apply_chat_template(messages))


async def test_models_and_model_info_name_no_hub_path(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    status, models = await get(http, f"{engine.url}/v1/models")
    assert status == 200
    assert [(m["id"], m["parent"]) for m in models["data"]] == [
        ("kvroute-emulated", None),
        ("sql-adapter", "kvroute-emulated"),
    ]
    status, info = await get(http, f"{engine.url}/model_info")
    assert status == 200 and info["model"] == "kvroute-emulated"
    assert "/" not in str(models) + str(info)


async def test_server_info_reports_what_was_bound(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    status, info = await get(http, f"{engine.url}/server_info")
    assert status == 200
    assert info["engine_id"] == "shared" and info["role"] == "both"
    assert (info["block_size"], info["num_gpu_blocks"], info["dp_size"]) == (16, 1_024, 1)
    assert info["kv_events_endpoint"].startswith("ipc://")
    replay = info["kv_events_replay_endpoint"]
    assert replay.startswith("tcp://127.0.0.1:") and not replay.endswith(":*")
    assert info["kv_events_topic"] == f"kv@127.0.0.1:{engine.port}@kvroute-emulated"


async def test_kv_event_sources_answers_as_vllm_0_32_does(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    status, sources = await get(http, f"{engine.url}/kv_event_sources")
    assert status == 200 and list(sources) == ["0"]
    rank0 = sources["0"]
    assert rank0["enable_kv_cache_events"] is True and rank0["publisher"] == "zmq"
    assert rank0["endpoint"] == engine.kv_events_endpoint
    assert rank0["replay_endpoint"] == engine.kv_events_replay_endpoint
    assert rank0["topic"] == engine.kv_events_topic and rank0["buffer_steps"] == 10_000


async def test_health(engine: EmulatedEngine, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{engine.url}/health") as resp:
        assert resp.status == 200


async def test_a_lora_adapter_has_its_own_prefix_space(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    prompt = text_prompt(100)
    await complete(http, engine, prompt=prompt)
    lora = await complete(http, engine, prompt=prompt, model="sql-adapter")
    assert lora["model"] == "sql-adapter"
    assert lora["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/v1/completions", b"{not json", 400, "JSON"),
        ("/v1/completions", b"[1, 2]", 400, "object"),
        ("/v1/completions", {"max_tokens": 2}, 400, "prompt"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, -1]}, 400, "out of vocabulary"),
        ("/v1/completions", {"prompt": [1, 10**9]}, 400, "out of vocabulary"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "n": 0}, 400, "`n`"),
        ("/v1/completions", {"prompt": "x", "stream_options": {}}, 400, "stream=True"),
        ("/v1/completions", {"prompt": "x", "cache_salt": ""}, 400, "cache_salt"),
        ("/v1/completions", {"prompt": "x " * 16_384}, 400, "maximum context length is 16384"),
        ("/v1/completions", {"prompt": "x", "model": "other"}, 404, "does not exist"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot"}]}, 400, "role"),
        ("/tokenize", {}, 400, "prompt"),
        ("/detokenize", {"tokens": [10**9]}, 400, "out of vocabulary"),
        ("/v1/completions/render", {"prompt": "x", "model": "other"}, 404, "does not exist"),
        ("/no/such/path", {}, 404, "Not Found"),
    ],
)
async def test_bad_requests_get_openai_errors(
    engine: EmulatedEngine,
    http: aiohttp.ClientSession,
    path: str,
    body: Any,
    status: int,
    fragment: str,
) -> None:
    got, answer = await post(http, f"{engine.url}{path}", body)
    assert got == status
    error = answer["error"]
    assert fragment in error["message"] and error["code"] == status
    # vLLM types a body that is not JSON with the reason phrase (FastAPI's handler).
    expected = "Bad Request" if body == b"{not json" else "BadRequestError"
    assert error["type"] == ("NotFoundError" if status == 404 else expected)


MESSAGE = [{"role": "user", "content": "hi"}]
#: A valid body of each generation API.
GENERATION_BODIES = {
    "/v1/completions": {"prompt": "x", "max_tokens": 1},
    "/v1/chat/completions": {"messages": MESSAGE, "max_tokens": 1},
    "/v1/messages": {"model": "kvroute-emulated", "messages": MESSAGE, "max_tokens": 1},
    "/v1/responses": {"input": "x", "max_output_tokens": 1},
}


@pytest.mark.parametrize("path", list(GENERATION_BODIES))
@pytest.mark.parametrize(
    ("field", "value"), [("temperature", "hot"), ("vllm_xargs", {"kv_transfer_params": {}})]
)
async def test_a_field_of_the_wrong_type_is_refused_as_vllms_request_model_refuses_it(
    engine: EmulatedEngine, http: aiohttp.ClientSession, path: str, field: str, value: Any
) -> None:
    got, answer = await post(http, f"{engine.url}{path}", {**GENERATION_BODIES[path], field: value})
    assert got == 400
    assert answer["error"]["type"] == "Bad Request"  # FastAPI's validation handler
    assert answer["error"]["param"] == f"body.{field}"


async def test_what_vllms_request_models_coerce_is_accepted(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    for fields in (
        {"temperature": "0.5"},
        {"temperature": True},
        {"vllm_xargs": {"a": "b", "n": 1, "xs": [1, "y"], "flag": True}},
    ):
        body = {**GENERATION_BODIES["/v1/completions"], **fields}
        got, answer = await post(http, f"{engine.url}/v1/completions", body)
        assert got == 200, (fields, answer)


async def test_generate_tokens_answers_token_ids_streamed_or_not(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    body = {"token_ids": [11, 12, 13], "sampling_params": {"max_tokens": 3}}
    status, answer = await post(http, f"{engine.url}/inference/v1/generate", body)
    assert status == 200, answer
    assert answer["request_id"].startswith("generate-tokens-")
    (choice,) = answer["choices"]
    assert len(choice["token_ids"]) == 3 and choice["finish_reason"] == "length"
    assert answer["usage"]["prompt_tokens"] == 3
    events = await stream(
        http,
        f"{engine.url}/inference/v1/generate",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    tokens = [
        t for e in events if isinstance(e, dict) for c in e["choices"] for t in c["token_ids"]
    ]
    assert tokens == choice["token_ids"]  # the same seed, the same answer
    assert events[-2]["usage"]["completion_tokens"] == 3 and events[-1] == "[DONE]"


async def test_generate_tokens_acts_on_kv_transfer_params_in_extra_args(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    """As vLLM's engine, which reads SamplingParams.extra_args: the pull it names is
    attempted (the dial counter stands for the side channel)."""
    counter = DialCounter()
    port = await counter.start()
    try:
        pull = hostile_handoff(port)["kv_transfer_params"]
        sampling = {"max_tokens": 2, "extra_args": {"kv_transfer_params": pull}}
        body = {"token_ids": [21, 22, 23], "sampling_params": sampling}
        status, answer = await post(http, f"{engine.url}/inference/v1/generate", body)
        assert status == 200, answer  # the failed pull is recomputed, as vLLM does
        assert counter.dials == 1
    finally:
        await counter.stop()


async def test_wrong_method_is_an_openai_error(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    status, answer = await get(http, f"{engine.url}/v1/completions")
    assert status == 405 and answer["error"]["code"] == 405


@pytest.mark.parametrize("streaming", [True, False])
async def test_a_client_that_leaves_aborts_its_request_and_frees_its_blocks(
    http: aiohttp.ClientSession, streaming: bool
) -> None:
    # Real time: the request would run for seconds if nobody aborted it.
    engine = await start_test_engine(time_scale=1.0)
    try:
        body = {"prompt": text_prompt(500), "max_tokens": 2_000, "stream": streaming}

        async def call() -> None:
            async with http.post(f"{engine.url}/v1/completions", json=body) as resp:
                if streaming:
                    await resp.content.readline()  # the first token arrived
                    return  # leaving the block closes the connection
                await resp.read()

        async def load() -> tuple[float, float]:
            samples = await metrics(http, engine.url)
            running = metric(samples, "vllm:num_requests_running")
            return running, metric(samples, "vllm:kv_cache_usage_perc")

        async def busy() -> bool:
            running, usage = await load()
            return running == 1 and usage > 0

        async def idle() -> bool:
            return await load() == (0, 0)

        task = asyncio.ensure_future(call())
        await poll(busy)
        if streaming:
            await task
        else:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await poll(idle)
    finally:
        await engine.stop()


async def test_reset_is_refused_while_requests_hold_blocks(http: aiohttp.ClientSession) -> None:
    engine = await start_test_engine(time_scale=1.0)
    try:
        body = {"prompt": text_prompt(100), "max_tokens": 1_000, "stream": True}
        async with http.post(f"{engine.url}/v1/completions", json=body) as resp:
            await resp.content.readline()
            status, answer = await post(http, f"{engine.url}/reset_prefix_cache", {})
        assert status == 409 and "in flight" in answer["error"]["message"]
    finally:
        await engine.stop()
