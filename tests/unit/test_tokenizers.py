"""Tokenizer modes: Hugging Face (a tiny tokenizer trained here, no downloads), approximate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.hf_tokenizer import FIXTURE
from tokenizers import Tokenizer

from router.tokenization import ApproximateTokenizer, HFTokenizer, TokenizeError


@pytest.fixture(scope="module")
def hf(tokenizer_json: Path) -> HFTokenizer:
    return HFTokenizer(tokenizer_json, FIXTURE)


async def test_hf_prompts_match_the_tokenizer_itself_with_special_tokens(
    hf: HFTokenizer, tokenizer_json: Path
) -> None:
    reference = Tokenizer.from_file(str(tokenizer_json))
    text = "the router sends a block of the prompt"
    ids = await hf.prompt(text)
    assert ids == reference.encode(text).ids
    assert ids[0] == reference.token_to_id("<s>")


def test_hf_chat_renders_like_transformers(hf: HFTokenizer) -> None:
    messages = [
        {"role": "system", "content": "  you are a helpful assistant  "},
        {"role": "user", "content": "what is a block"},
        {"role": "assistant", "content": "sixteen tokens"},
        {"role": "user", "content": "and prefill"},
    ]
    rendered = hf.render(messages, add_generation_prompt=True)
    assert rendered == (
        "<s><|start_header_id|>system<|end_header_id|>\n\nyou are a helpful assistant<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nwhat is a block<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nsixteen tokens<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nand prefill<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    without = hf.render(messages[1:2], add_generation_prompt=False)
    assert without == "<s><|start_header_id|>user<|end_header_id|>\n\nwhat is a block<|eot_id|>"


async def test_hf_chat_has_exactly_one_bos(hf: HFTokenizer, tokenizer_json: Path) -> None:
    bos = Tokenizer.from_file(str(tokenizer_json)).token_to_id("<s>")
    ids = await hf.chat([{"role": "user", "content": "what is a block"}])
    assert ids[0] == bos and ids.count(bos) == 1


async def test_template_errors_are_client_errors(hf: HFTokenizer) -> None:
    with pytest.raises(TokenizeError, match="roles must be user or assistant"):
        await hf.chat([{"role": "tool", "content": "x"}])


async def test_a_model_without_a_template_refuses_chats(
    tokenizer_json: Path, tmp_path: Path
) -> None:
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(TokenizeError, match="no chat template"):
        await HFTokenizer(tokenizer_json, config).chat([{"role": "user", "content": "x"}])


async def test_approximate_mode_chunks_characters() -> None:
    approx = ApproximateTokenizer(chars_per_token=4)
    a = await approx.prompt("abcdefghij" * 10)
    b = await approx.prompt("abcdefghij" * 10 + "different tail")
    assert len(a) == 25
    assert b[:25] == a  # a shared text prefix gives shared pseudo-tokens
    chat = await approx.chat([{"role": "user", "content": "hello"}])
    assert chat == await approx.prompt("user: hello\n")
