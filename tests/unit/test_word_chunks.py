"""The word tokenizer's chunk cache (issue 25): long texts are encoded in whitespace-cut
chunks whose ids are remembered; the ids must be exactly those of encoding word by word."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

import router.tokenization.words as words
from router.tokenization.words import CHUNK_CHARS, WordTokenizer, word_id

# Every kind of whitespace str.split() cuts at, besides letters and the chat markers.
_SPACES = [
    " ",
    "\n",
    "\t",
    "\r",
    "\x0b",
    "\x0c",
    "\x1c",
    "\x1f",
    "\x85",
    "\xa0",
    "\u2003",
    "\u3000",
]
_PIECES = st.one_of(
    st.text(alphabet="abcxyz0123", min_size=1, max_size=12),
    st.sampled_from(_SPACES),
    st.sampled_from(["<|user|>", "<|end|>", "<|image|>", "ünï", "\U0001f600"]),
)


def reference(text: str) -> list[int]:
    return [word_id(w) for w in text.split()]


@given(st.lists(_PIECES, min_size=0, max_size=1500), st.integers(0, 2))
def test_chunked_ids_are_the_word_by_word_ids(pieces: list[str], copies: int) -> None:
    text = "".join(pieces) * (copies * 40 + 1)  # short texts, and long ones cut in chunks
    tokenizer = WordTokenizer()
    assert tokenizer.encode(text) == reference(text)
    assert tokenizer.encode(text) == reference(text)  # again, from remembered chunks


@given(st.integers(0, 3 * CHUNK_CHARS), st.sampled_from(_SPACES))
def test_texts_without_spaces_cut_at_other_whitespace(length: int, space: str) -> None:
    text = space.join("w" * 7 for _ in range(length // 8 + 1))
    assert WordTokenizer().encode(text) == reference(text)


def test_prompts_sharing_a_prefix_reuse_its_chunks() -> None:
    tokenizer = WordTokenizer()
    prefix = " ".join(f"shared{i}" for i in range(2_000))
    first = tokenizer.encode(prefix + " question one")
    remembered = len(tokenizer._chunks)
    assert remembered >= 10
    second = tokenizer.encode(prefix + " question two, longer than the first")
    assert len(tokenizer._chunks) == remembered  # every chunk of the prefix was found
    assert first[:2_000] == second[:2_000] == reference(prefix)
    assert second == reference(prefix + " question two, longer than the first")


def test_remembered_chunks_are_bounded(monkeypatch: object) -> None:
    monkeypatch.setattr(words, "CHUNKS_REMEMBERED", 8)  # type: ignore[attr-defined]
    tokenizer = WordTokenizer()
    for n in range(5):
        text = " ".join(f"t{n}w{i}" for i in range(1_000))
        assert tokenizer.encode(text) == reference(text)
    assert len(tokenizer._chunks) == 8
