"""The word tokenizer's chunk cache (issue 25): long texts are encoded in whitespace-cut
chunks whose ids are remembered; the ids must be exactly those of encoding word by word."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

import router.tokenization.words as words
from router.hashing import block_keys, native_helper
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


def test_a_chunk_runs_long_only_to_the_end_of_a_long_word() -> None:
    tokenizer = WordTokenizer()
    # Newlines close by, the next space far away: the cut is at a newline.
    text = "\n".join(f"w{i}" for i in range(20_000)) + " tail"
    assert tokenizer.encode(text) == reference(text)
    assert max(len(piece) for piece in tokenizer._chunks) < 2 * CHUNK_CHARS
    # One word longer than a chunk: that chunk ends where the word does.
    long_word = "x" * (5 * CHUNK_CHARS)
    text = " ".join(["a"] * 300 + [long_word] + ["b"] * 300)
    assert tokenizer.encode(text) == reference(text)
    assert tokenizer._chunk_chars == sum(len(piece) for piece in tokenizer._chunks)


def test_remembered_chunks_are_bounded_by_characters(monkeypatch: object) -> None:
    monkeypatch.setattr(words, "CHUNK_CHARS_HELD", 3 * CHUNK_CHARS)  # type: ignore[attr-defined]
    tokenizer = WordTokenizer()
    text = " ".join(f"c{i}" for i in range(5_000))
    assert tokenizer.encode(text) == reference(text)
    assert 0 < tokenizer._chunk_chars <= 3 * CHUNK_CHARS


# ------------------------------------------------------------- the compiled helper

_ASCII_PIECES = st.one_of(
    st.text(alphabet="abcxyz0123<|>", min_size=1, max_size=12),
    st.sampled_from([" ", "\n", "\t", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x1f"]),
    st.sampled_from(["<|user|>", "<|end|>", "<|image|>", "<|nope|>", "<|", "|>"]),
)


@given(st.lists(_ASCII_PIECES, min_size=0, max_size=800))
def test_the_helper_gives_the_word_by_word_ids(pieces: list[str]) -> None:
    """The router's tokenizer (``decodes=False``) takes ASCII text through the compiled
    helper when it is built; the ids are the Python path's, markers and str.split()'s
    ASCII whitespace (\\x1c-\\x1f included) alike."""
    text = "".join(pieces)
    assert WordTokenizer(decodes=False).encode(text) == reference(text)


@given(st.lists(_PIECES, min_size=0, max_size=400))
def test_the_router_tokenizer_gives_the_same_ids_for_any_text(pieces: list[str]) -> None:
    text = "".join(pieces) * 3
    assert WordTokenizer(decodes=False).encode(text) == reference(text)


def test_the_router_tokenizer_takes_the_helper_when_built() -> None:
    if words._NATIVE_WORD_IDS is None:
        pytest.skip("the compiled helper is not built here")
    tokenizer = WordTokenizer(decodes=False)
    text = " ".join(f"w{i}" for i in range(5_000))
    assert tokenizer.encode(text) == reference(text)
    assert not tokenizer._chunks  # ASCII text never took the chunked Python path
    assert tokenizer.encode("naïve words") == reference("naïve words")  # non-ASCII: Python


@given(st.lists(_PIECES, min_size=0, max_size=400))
def test_packed_ids_are_the_word_by_word_ids(pieces: list[str]) -> None:
    """``ids()`` (what routing reads: packed when the helper encodes the text) gives
    ``encode()``'s ids for any text, ASCII or not, on the router's and the emulator's
    tokenizer alike."""
    text = "".join(pieces)
    for tokenizer in (WordTokenizer(decodes=False), WordTokenizer()):
        assert list(tokenizer.ids(text)) == reference(text)


def test_packed_ids_are_an_array_that_block_hashing_reads_as_the_list() -> None:
    if words._NATIVE_PACKED is None:
        pytest.skip("the compiled helper is not built here")
    text = " ".join(f"w{i}" for i in range(1_000)) + " <|user|> <|nope|>"
    ids = WordTokenizer(decodes=False).ids(text)
    assert isinstance(ids, array) and ids.typecode == "I"
    assert ids.tolist() == reference(text)
    assert block_keys(ids, 16, 7) == block_keys(reference(text), 16, 7)
    assert isinstance(WordTokenizer(decodes=False).ids("naïve words"), list)  # Python path
    assert isinstance(WordTokenizer().ids(text), list)  # the emulator's: no helper


def test_the_helper_refuses_a_span_outside_uint32() -> None:
    helper = native_helper()
    if helper is None:
        pytest.skip("the compiled helper is not built here")
    for fn in (helper.word_ids, helper.word_ids_packed):
        with pytest.raises(ValueError, match="span"):
            fn("a b", {}, 1, 0)
        with pytest.raises(OverflowError):
            fn("a b", {}, 2**32 - 1, 2)
        assert fn("a b", {}, 0, 2**32) is not None  # ids up to 2**32 - 1 fit


def test_the_emulator_tokenizer_still_decodes_what_it_encoded() -> None:
    tokenizer = WordTokenizer()
    ids = tokenizer.encode("alpha beta gamma")
    assert tokenizer.decode(ids) == "alpha beta gamma"
