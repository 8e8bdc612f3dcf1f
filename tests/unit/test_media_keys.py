"""Media parts in block keys: identifiers, placeholder spans, and the key chain."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import msgspec
import pytest
from support.hf_tokenizer import FIXTURE

from router.config import Config
from router.emulator.protocol import chat_prompt as emulator_chat_prompt
from router.hashing import block_keys, seed_for
from router.media import MediaSpan, block_extra_keys, media_item
from router.tokenization import (
    ApproximateTokenizer,
    EngineTokenizer,
    HFTokenizer,
    TokenizeError,
    Tokenizers,
    WordsTokenizer,
)
from router.tokenization.words import WordTokenizer, render_chat

BS = 16
SEED = seed_for("kvroute-emulated")
INTRO = " ".join(f"intro{i}" for i in range(40))  # 40 words: the image lands in block 2
QUESTION = "what does this picture show " * 4


def image(url: str, uuid: str | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def chat(*media: dict[str, Any]) -> list[dict[str, Any]]:
    content = [{"type": "text", "text": INTRO}, *media, {"type": "text", "text": QUESTION}]
    return [{"role": "user", "content": content}]


def data_url(payload: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(payload).decode()


async def keys_of(messages: list[dict[str, Any]], placeholders: int = 20) -> list[int]:
    prompt = await WordsTokenizer(placeholder_tokens=placeholders).chat_prompt(messages)
    return block_keys(prompt.tokens, BS, SEED, extra=block_extra_keys(prompt.media, BS))


async def test_text_only_chats_keep_their_keys() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": INTRO}]}]
    prompt = await WordsTokenizer().chat_prompt(messages)
    assert prompt.media == []
    assert render_chat(messages) == f"<|user|> {INTRO} <|end|> <|assistant|>"
    plain = block_keys(WordTokenizer().encode(render_chat(messages)), BS, SEED)
    assert await keys_of(messages) == plain
    assert block_keys(prompt.tokens, BS, SEED, extra={}) == plain


async def test_different_images_change_keys_from_the_placeholder_block_on() -> None:
    a = await keys_of(chat(image("https://img.example/cat.png")))
    b = await keys_of(chat(image("https://img.example/dog.png")))
    # <|user|> + 40 words: the first placeholder is token 41, in block 2.
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))
    assert len(a) == len(b) > 4


async def test_the_same_image_twice_gives_the_same_keys() -> None:
    url = data_url(b"\x89PNG same bytes")
    assert await keys_of(chat(image(url))) == await keys_of(chat(image(url)))


async def test_data_urls_are_told_apart_by_their_bytes() -> None:
    a = await keys_of(chat(image(data_url(b"\x89PNG one"))))
    b = await keys_of(chat(image(data_url(b"\x89PNG two"))))
    assert a[:2] == b[:2] and a[2] != b[2]


async def test_a_client_uuid_names_the_item_instead_of_its_url() -> None:
    same_uuid = await keys_of(chat(image("https://a.example/x.png", uuid="photo-1")))
    assert same_uuid == await keys_of(chat(image("https://b.example/y.png", uuid="photo-1")))
    assert same_uuid[2] != (await keys_of(chat(image("https://a.example/x.png", uuid="p-2"))))[2]
    assert same_uuid[2] != (await keys_of(chat(image("https://a.example/x.png"))))[2]
    assert media_item(image("https://a.example/x.png", uuid="photo-1")).identifier == "photo-1"


async def test_where_the_image_sits_matters_not_only_which() -> None:
    url = "https://img.example/cat.png"
    first = chat(image(url))
    second = [{"role": "user", "content": [{"type": "text", "text": INTRO}, image(url)]}]
    second[0]["content"].insert(1, {"type": "text", "text": "one more word"})
    a, b = await keys_of(first), await keys_of(second)
    assert a[:2] == b[:2] and a[2] != b[2]


async def test_audio_and_video_parts_are_media_too() -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    video = {"type": "video_url", "video_url": {"url": "https://v.example/clip.mp4"}}
    prompt = await WordsTokenizer(placeholder_tokens=3).chat_prompt(chat(audio, video))
    assert [(s.offset, s.length) for s in prompt.media] == [(41, 3), (44, 3)]
    assert media_item(audio).modality == "audio" and media_item(video).modality == "video"
    other = {"type": "input_audio", "input_audio": {"data": "UklGRh==", "format": "wav"}}
    assert (await keys_of(chat(audio)))[2] != (await keys_of(chat(other)))[2]


async def test_a_media_part_without_its_data_is_a_client_error() -> None:
    with pytest.raises(TokenizeError, match="non-empty URL"):
        await WordsTokenizer().chat_prompt(chat({"type": "image_url", "image_url": {}}))
    # With a uuid the data may be left out, as vLLM allows for cached items.
    part = {"type": "image_url", "image_url": None, "uuid": "cached-1"}
    assert (await WordsTokenizer().chat_prompt(chat(part))).media[0].identifier == "cached-1"


def test_items_spanning_blocks_carry_vllms_relative_offsets() -> None:
    spans = [MediaSpan("a", 10, 30), MediaSpan("b", 40, 4)]
    assert block_extra_keys(spans, BS) == {
        0: [("a", 10)],
        1: [("a", -6)],
        2: [("a", -22), ("b", 8)],
    }


async def test_the_emulator_and_the_router_place_placeholders_alike() -> None:
    messages = chat(image("https://img.example/cat.png"))
    ids, media = emulator_chat_prompt({"messages": messages}, WordTokenizer(), 20)
    prompt = await WordsTokenizer(placeholder_tokens=20).chat_prompt(messages)
    assert (ids, media) == (prompt.tokens, prompt.media)
    assert len(ids) == 1 + 40 + 20 + len(QUESTION.split()) + 2


# --------------------------------------------------------------------------- other modes

PARTS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
    "\n\n{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}<image>{% elif p.type == 'text' %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def conversation(*media: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "the router sends a block of the prompt " * 6},
        {"role": "assistant", "content": "the block holds sixteen tokens " * 6},
        {"role": "user", "content": [*media, {"type": "text", "text": "and this one?"}]},
    ]


async def test_hf_mode_places_items_no_later_than_their_message(tokenizer_json: Path) -> None:
    hf = HFTokenizer(tokenizer_json, FIXTURE, chat_template=PARTS_TEMPLATE)
    first = await hf.chat_prompt(conversation(image("https://img.example/cat.png")))
    second = await hf.chat_prompt(conversation(image("https://img.example/dog.png")))
    # The template draws the image part: its placeholder text is in the prompt.
    assert "<image>" in hf.render(conversation(image("https://img.example/cat.png")))
    before = await hf.chat(conversation()[:2], add_generation_prompt=False)
    assert first.tokens[: len(before)] == before
    (span,) = first.media
    assert span.offset == len(before) - 1
    a = block_keys(first.tokens, 4, SEED, extra=block_extra_keys(first.media, 4))
    b = block_keys(second.tokens, 4, SEED, extra=block_extra_keys(second.media, 4))
    cut = span.offset // 4
    assert a[:cut] == b[:cut] and a[cut] != b[cut]


async def test_hf_mode_places_an_item_of_the_first_message_at_the_start(
    tokenizer_json: Path,
) -> None:
    hf = HFTokenizer(tokenizer_json, FIXTURE, chat_template=PARTS_TEMPLATE)
    prompt = await hf.chat_prompt([{"role": "user", "content": [image("https://x.example/a")]}])
    assert [s.offset for s in prompt.media] == [0]


async def test_engine_mode_asks_for_the_messages_before_the_item() -> None:
    asked: list[dict[str, Any]] = []
    words = WordTokenizer()

    async def tokenize(path: str, body: bytes) -> tuple[int, bytes]:
        request = msgspec.json.decode(body)
        asked.append(request)
        ids, _ = emulator_chat_prompt(request, words, 20)
        return 200, msgspec.json.encode({"tokens": ids})

    engine = EngineTokenizer("m", tokenize)
    messages = conversation(image("https://img.example/cat.png"))
    prompt = await engine.chat_prompt(messages)
    assert len(asked) == 2 and asked[1]["messages"] == messages[:2]
    assert asked[1]["add_generation_prompt"] is False
    # The engine's own tokens (with its placeholders), the item at its message's start.
    assert prompt.tokens == emulator_chat_prompt({"messages": messages}, words, 20)[0]
    shorter = {"messages": messages[:2], "add_generation_prompt": False}
    before, _ = emulator_chat_prompt(shorter, words, 20)
    assert [s.offset for s in prompt.media] == [len(before) - 1]


async def test_approximate_mode_tells_images_apart_from_their_message_on() -> None:
    approx = ApproximateTokenizer(chars_per_token=4)
    first = await approx.chat_prompt(conversation(image("https://img.example/cat.png")))
    second = await approx.chat_prompt(conversation(image("https://img.example/dog.png")))
    assert first.tokens == second.tokens  # approximate tokens see text only
    text_before = sum(len(f"{m['role']}: {m['content']}\n") for m in conversation()[:2])
    assert [s.offset for s in first.media] == [text_before // 4]
    a = block_keys(first.tokens, 4, SEED, extra=block_extra_keys(first.media, 4))
    b = block_keys(second.tokens, 4, SEED, extra=block_extra_keys(second.media, 4))
    cut = first.media[0].offset // 4
    assert a[:cut] == b[:cut] and a[cut] != b[cut]


async def test_the_guard_ignores_media_chats_of_modes_that_cannot_count_placeholders(
    tokenizer_json: Path,
) -> None:
    config = Config.model_validate(
        {"tokenizer": {"mode": "hf", "path": str(tokenizer_json), "config_path": str(FIXTURE)}}
    )

    async def post(model: str, path: str, body: bytes) -> tuple[int, bytes]:
        raise AssertionError("hf mode asks no engine")

    pools = Tokenizers(config, post)
    for _ in range(60):
        assert not pools.observe("m", 100, 676, media=True)
    assert pools.mismatches() == {"m": 0}
    assert pools.modes() == {"m": "hf"}
    # Text-only disagreements still count.
    pools.observe("m", 100, 101)
    assert pools.mismatches() == {"m": 1}
