"""Recent prompts' token ids remembered by the hf and approximate modes (issue 25): a
prompt or chat sent again is not tokenized again, a conversation's next turn tokenizes
only what follows the last special token of the turn before, the ids are always those
the tokenizer gives for the whole text, and what is held stays within its bounds."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest
from support.hf_tokenizer import FIXTURE, SPECIAL
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

from router.config import load_config
from router.tokenization import ApproximateTokenizer, HFTokenizer
from router.tokenization.base import RecentPrompts
from router.tokenization.modes import THREAD_MIN_CHARS

CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "you are a helpful assistant"},
    {"role": "user", "content": "what is a block"},
]


@pytest.fixture
def hf(tokenizer_json: Path) -> HFTokenizer:
    return HFTokenizer(tokenizer_json, FIXTURE, recent_tokens=10_000)


class Counting:
    """A tokenizers.Tokenizer that counts its encodes."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.encodes = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        self.encodes += 1
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> Any:
        return [self.encode(text, add_special_tokens) for text in texts]


async def test_a_prompt_sent_again_is_not_tokenized_again(
    hf: HFTokenizer, tokenizer_json: Path
) -> None:
    reference = Tokenizer.from_file(str(tokenizer_json))
    counting = Counting(hf.tokenizer)
    hf.tokenizer = counting  # type: ignore[assignment]
    text = "the router sends a block of the prompt"
    first = await hf.prompt(text)
    second = await hf.prompt(text)
    assert first == second == reference.encode(text).ids
    assert counting.encodes == 1
    assert (hf.recent.hits, hf.recent.misses) == (1, 1)
    first.append(-1)  # each caller gets its own list
    assert await hf.prompt(text) == second
    assert await hf.prompt(text + " again") == reference.encode(text + " again").ids
    assert counting.encodes == 2


async def test_chats_are_remembered_by_everything_that_changes_their_tokens(
    hf: HFTokenizer,
) -> None:
    counting = Counting(hf.tokenizer)
    hf.tokenizer = counting  # type: ignore[assignment]
    with_prompt = await hf.chat(CHAT, add_generation_prompt=True)
    without = await hf.chat(CHAT, add_generation_prompt=False)
    assert with_prompt != without
    assert await hf.chat(CHAT, add_generation_prompt=True) == with_prompt
    assert await hf.chat([*CHAT[:1], {"role": "user", "content": "what is a blocks"}]) != (
        with_prompt
    )
    assert counting.encodes == 3
    # A completion of the chat's rendered text is not answered from the chat's entry.
    await hf.prompt(hf.render(CHAT, add_generation_prompt=True))
    assert counting.encodes == 4


async def test_remembered_tokens_stay_within_their_bounds() -> None:
    recent = RecentPrompts(max_tokens=10, max_entries=3)
    for n in range(5):
        recent.put(recent.text_key(b"p", f"t{n}"), [n, n, n])
    assert len(recent) == 3 and recent.tokens == 9  # entries bound: the oldest went
    assert recent.get(recent.text_key(b"p", "t0")) is None
    assert recent.get(recent.text_key(b"p", "t4")) == [4, 4, 4]
    recent.put(recent.text_key(b"p", "big"), list(range(4)))
    assert recent.tokens <= 10 and recent.get(recent.text_key(b"p", "t2")) is None
    recent.put(recent.text_key(b"p", "huge"), list(range(11)))  # larger than the whole
    assert recent.get(recent.text_key(b"p", "huge")) is None
    recent.put(recent.text_key(b"p", "wide"), [1 << 40])  # not a uint32 id: not kept
    assert recent.get(recent.text_key(b"p", "wide")) is None


async def test_zero_turns_it_off_and_odd_chats_are_not_remembered(
    tokenizer_json: Path,
) -> None:
    off = HFTokenizer(tokenizer_json, FIXTURE, recent_tokens=0)
    await off.prompt("a block")
    await off.prompt("a block")
    assert len(off.recent) == 0 and off.recent.misses == 0
    assert RecentPrompts.chat_key(b"c", [{"role": "user", "content": object()}], True, None) is (
        None
    )


async def test_approximate_mode_remembers_too() -> None:
    approximate = ApproximateTokenizer(4, recent_tokens=1_000)
    fresh = ApproximateTokenizer(4)
    text = "a prompt long enough for several pseudo-tokens"
    assert await approximate.prompt(text) == await approximate.prompt(text)
    assert await approximate.prompt(text) == await fresh.prompt(text)
    assert approximate.recent.hits == 2


def test_the_bound_is_configured_per_tokenizer() -> None:
    config = load_config(overrides={"tokenizer": {"recent_prompt_tokens": 0}}, environ={})
    assert config.tokenizer.recent_prompt_tokens == 0
    assert load_config(environ={}).tokenizer.recent_prompt_tokens == 4_194_304


# --------------------------------------------------------------------------- chat prefixes


def _conversation(seed: int, turns: int) -> list[list[dict[str, Any]]]:
    """Each turn's messages: a growing conversation with awkward text at the edges."""
    rng = random.Random(seed)
    words = "the router sends each request where its prefix is cached block 42".split()
    edges = ["", " ", "\n", "\n\n", "  ", "!?", " 123", "\t"]
    chat: list[dict[str, Any]] = [{"role": "system", "content": "you are a helpful assistant"}]
    out = []
    for _ in range(turns):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(0, 40)))
        chat.append({"role": "user", "content": rng.choice(edges) + text + rng.choice(edges)})
        out.append(list(chat))
        reply = " ".join(rng.choice(words) for _ in range(rng.randint(0, 30)))
        chat.append({"role": "assistant", "content": reply + rng.choice(edges)})
    return out


class Lengths(Counting):
    """Also records how many characters each encode was given."""

    def __init__(self, inner: Tokenizer) -> None:
        super().__init__(inner)
        self.lengths: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        self.lengths.append(len(text))
        return super().encode(text, add_special_tokens)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_conversation_tokenizes_only_its_new_turn_with_the_same_ids(
    tokenizer_json: Path, seed: int
) -> None:
    resumed = HFTokenizer(tokenizer_json, FIXTURE, recent_tokens=100_000)
    whole = HFTokenizer(tokenizer_json, FIXTURE, recent_tokens=0)
    assert "<|eot_id|>" in resumed._cuts and "<|start_header_id|>" in resumed._cuts
    lengths = Lengths(resumed.tokenizer)
    resumed.tokenizer = lengths  # type: ignore[assignment]
    for turn, messages in enumerate(_conversation(seed, 10)):
        assert await resumed.chat(messages) == await whole.chat(messages), turn
        rendered = len(resumed.render(messages))
        if turn:  # only what follows the previous turn's last special token
            assert lengths.lengths[-1] < rendered - 40
    assert lengths.encodes == 10


def _tokenizer_with(pre_tokenizer: Any, special: list[AddedToken]) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizer
    tok.train_from_iterator(
        ["the router sends each request where its prefix is cached"] * 20,
        trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", *special]),
    )
    return tok


async def test_tokenizers_that_do_not_cut_cleanly_tokenize_chats_whole(tmp_path: Path) -> None:
    specials = [AddedToken(t, special=True, normalized=False) for t in SPECIAL[1:]]
    # Metaspace with prepend_scheme "first" marks only an input's first word: a part
    # tokenized on its own would differ, so the probe keeps chats whole.
    first = _tokenizer_with(pre_tokenizers.Metaspace(prepend_scheme="first"), specials)
    first.save(str(tmp_path / "first.json"))
    hf = HFTokenizer(tmp_path / "first.json", FIXTURE, recent_tokens=100_000)
    assert hf._cuts == {}
    whole = Tokenizer.from_file(str(tmp_path / "first.json"))
    for messages in _conversation(4, 3):
        text = hf.render(messages)
        assert await hf.chat(messages) == whole.encode(text, add_special_tokens=False).ids
    # A special token that strips the whitespace after it never cuts.
    stripping = [AddedToken("<|eot_id|>", special=True, normalized=False, rstrip=True)]
    tok = _tokenizer_with(pre_tokenizers.Whitespace(), stripping)
    tok.save(str(tmp_path / "strip.json"))
    assert (
        "<|eot_id|>" not in HFTokenizer(tmp_path / "strip.json", FIXTURE, recent_tokens=1_000)._cuts
    )


async def test_long_texts_tokenize_off_the_event_loop(tokenizer_json: Path) -> None:
    hf = HFTokenizer(tokenizer_json, FIXTURE, recent_tokens=0)
    reference = Tokenizer.from_file(str(tokenizer_json))
    text = "the router sends a block of the prompt, and prefill is compute bound. " * 3_000
    assert len(text) >= THREAD_MIN_CHARS
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.ensure_future(ticker())
    await asyncio.sleep(0)
    before = ticks
    ids = await hf.prompt(text)
    done = True
    await task
    assert ids == reference.encode(text).ids  # special tokens as encode adds them
    assert ids[0] == reference.token_to_id("<s>")
    assert ticks > before + 1  # the loop ran other work while the text was tokenized
    chat = [{"role": "user", "content": text}]
    assert await hf.chat(chat) == reference.encode(hf.render(chat), add_special_tokens=False).ids


async def test_a_template_that_reads_the_clock_is_never_answered_from_memory(
    tokenizer_json: Path, tmp_path: Path
) -> None:
    dated = tmp_path / "tokenizer_config.json"
    template = "{{ bos_token }}today {{ strftime_now('%d %B %Y') }}{% for m in messages %}"
    template += "<|start_header_id|>{{ m['role'] }}<|end_header_id|>{{ m['content'] }}"
    template += "<|eot_id|>{% endfor %}"
    dated.write_text(json.dumps({"bos_token": "<s>", "chat_template": template}))
    hf = HFTokenizer(tokenizer_json, dated, recent_tokens=100_000)
    assert not hf.remembers_chats
    counting = Counting(hf.tokenizer)
    hf.tokenizer = counting  # type: ignore[assignment]
    await hf.chat(CHAT)
    await hf.chat(CHAT)
    assert counting.encodes == 2  # rendered (and dated) afresh each time
    assert HFTokenizer(tokenizer_json, FIXTURE, recent_tokens=1).remembers_chats


async def test_single_word_tokens_and_unencodable_probes_keep_chats_whole(
    tmp_path: Path,
) -> None:
    # A single-word token right after a cut would see a word start there.
    specials = [AddedToken(t, special=True, normalized=False) for t in SPECIAL[1:]]
    tok = _tokenizer_with(pre_tokenizers.Whitespace(), specials)
    tok.add_tokens([AddedToken("foo", single_word=True)])
    tok.save(str(tmp_path / "single.json"))
    assert HFTokenizer(tmp_path / "single.json", FIXTURE, recent_tokens=1_000)._cuts == {}
    # A tokenizer that cannot encode the probe's words still loads (chats stay whole).
    level = Tokenizer(models.WordLevel({"<|eot_id|>": 0, "a": 1}))
    level.pre_tokenizer = pre_tokenizers.Whitespace()
    level.add_special_tokens([AddedToken("<|eot_id|>", special=True, normalized=False)])
    level.save(str(tmp_path / "level.json"))
    assert HFTokenizer(tmp_path / "level.json", FIXTURE, recent_tokens=1_000)._cuts == {}


async def test_tokenizer_json_truncation_and_padding_are_not_applied(
    tokenizer_json: Path, tmp_path: Path
) -> None:
    reference = Tokenizer.from_file(str(tokenizer_json))
    truncating = Tokenizer.from_file(str(tokenizer_json))
    truncating.enable_truncation(4)
    truncating.enable_padding(length=64)
    truncating.save(str(tmp_path / "truncating.json"))
    hf = HFTokenizer(tmp_path / "truncating.json", FIXTURE, recent_tokens=0)
    text = "the router sends a block of the prompt where its prefix is cached"
    assert await hf.prompt(text) == reference.encode(text).ids
