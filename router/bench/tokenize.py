"""What tokenizing with the model's own tokenizer (``tokenizer.mode: hf``) costs the router.

``python -m router.bench.tokenize`` (``make bench-tokenize``) trains a byte-level BPE of
32,000 tokens (GPT-2/Llama-3 style: byte-level pre-tokenizer, a BOS-adding
post-processor, Llama-3's chat special tokens) on the repository's own documentation and
Python sources, into ``build/bench-tokenizer`` (nothing is downloaded; about 10 s the
first time), with a Llama-3 chat template, and measures ``HFTokenizer`` in process:

* a ~1,000-token and a ~8,000-token completion prompt: tokenized afresh, and sent again
  (answered from ``tokenizer.recent_prompt_tokens``);
* a 16-turn conversation, each turn's whole chat tokenized as a chat completion: with
  the conversation's earlier turns remembered (the default) and without
  (``recent_prompt_tokens: 0``); the ids are checked equal turn by turn;
* the event loop while an ~8,000-token prompt is tokenized: how many times a task that
  only yields ran meanwhile, with the tokenization on the loop (``encode``) and on a
  worker thread (``encode_batch``, what the router does for texts of 2,048 characters
  or more).

Prints a table and writes ``bench-results/tokenize.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

from router.bench.report import save_results
from router.config import TokenizerConfig
from router.tokenization import HFTokenizer

OUT = Path("build/bench-tokenizer")
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"]
SPECIAL += ["<|eot_id|>"]
TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}"
)
REPO = Path(__file__).resolve().parents[2]
RECENT = TokenizerConfig.model_fields["recent_prompt_tokens"].default
"""``tokenizer.recent_prompt_tokens`` at its default."""


def corpus_files() -> list[str]:
    files = sorted(str(p) for p in (REPO / "docs").glob("*.md"))
    files += sorted(str(p) for p in (REPO / "router").rglob("*.py"))
    return files


def build_tokenizer() -> tuple[Path, Path]:
    """tokenizer.json and tokenizer_config.json of the benchmark's tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    path, config = OUT / "tokenizer.json", OUT / "tokenizer_config.json"
    if not path.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=32_000,
            special_tokens=SPECIAL,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train(corpus_files(), trainer)
        bos = tok.token_to_id(SPECIAL[0])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{SPECIAL[0]} $A", special_tokens=[(SPECIAL[0], bos)]
        )
        tok.save(str(path))
    config.write_text(json.dumps({"bos_token": SPECIAL[0], "chat_template": TEMPLATE}))
    return path, config


def _text_of(tok: HFTokenizer, source: str, tokens: int) -> str:
    """The longest prefix of ``source`` with at most ``tokens`` tokens."""
    lo, hi = 0, len(source)
    while hi - lo > 16:
        mid = (lo + hi) // 2
        if len(tok.tokenizer.encode(source[:mid]).ids) <= tokens:
            lo = mid
        else:
            hi = mid
    return source[:lo]


def _median_us(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2] * 1e6


async def _prompts(path: Path, config: Path, source: str, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for size in (1_000, 8_000):
        fresh_tok = HFTokenizer(path, config, recent_tokens=0)
        text = _text_of(fresh_tok, source, size)
        remembered = HFTokenizer(path, config, recent_tokens=RECENT)
        fresh, again = [], []
        for i in range(repeats):
            t0 = time.perf_counter()
            await fresh_tok.prompt(f"{i} {text}")  # a new prompt every time
            fresh.append(time.perf_counter() - t0)
        await remembered.prompt(text)
        for _ in range(repeats):
            t0 = time.perf_counter()
            await remembered.prompt(text)
            again.append(time.perf_counter() - t0)
        tokens = len(await fresh_tok.prompt(text))
        rows.append(
            {"tokens": tokens, "fresh_us": _median_us(fresh), "again_us": _median_us(again)}
        )
    return rows


async def _conversation(path: Path, config: Path, source: str, turns: int) -> dict[str, Any]:
    paragraphs = [p for p in source.split("\n\n") if len(p) > 200]
    rng = random.Random(7)
    resumed = HFTokenizer(path, config, recent_tokens=RECENT)
    whole = HFTokenizer(path, config, recent_tokens=0)
    chat: list[dict[str, str]] = [{"role": "system", "content": rng.choice(paragraphs)}]
    per_turn = []
    for _ in range(turns):
        chat.append({"role": "user", "content": rng.choice(paragraphs)})
        t0 = time.perf_counter()
        ids = await resumed.chat(chat)
        t1 = time.perf_counter()
        reference = await whole.chat(chat)
        t2 = time.perf_counter()
        if ids != reference:
            raise AssertionError("resumed tokenization differs from the whole text's")
        per_turn.append(
            {"tokens": len(ids), "whole_us": (t2 - t1) * 1e6, "resumed_us": (t1 - t0) * 1e6}
        )
        chat.append({"role": "assistant", "content": rng.choice(paragraphs)})
    return {
        "turns": per_turn,
        "whole_ms": sum(t["whole_us"] for t in per_turn) / 1e3,
        "resumed_ms": sum(t["resumed_us"] for t in per_turn) / 1e3,
    }


async def _loop_while_tokenizing(path: Path, config: Path, source: str) -> dict[str, Any]:
    tok = HFTokenizer(path, config, recent_tokens=0)
    text = _text_of(tok, source, 8_000)
    out: dict[str, Any] = {}
    state = {"ticks": 0, "stop": False}

    async def ticker() -> None:
        while not state["stop"]:
            state["ticks"] += 1
            await asyncio.sleep(0)

    for name in ("on the loop (encode)", "on a worker thread (encode_batch)"):
        state.update(ticks=0, stop=False)
        task = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        before = state["ticks"]
        t0 = time.perf_counter()
        if name.startswith("on the loop"):
            tok.tokenizer.encode(text)
        else:
            await tok.prompt(text)
        elapsed = time.perf_counter() - t0
        state["stop"] = True
        await task
        out[name] = {"ms": elapsed * 1e3, "loop_turns": state["ticks"] - before}
    return out


def _documentation() -> str:
    return "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))


async def measure(repeats: int, turns: int) -> dict[str, Any]:
    path, config = await asyncio.to_thread(build_tokenizer)
    source = await asyncio.to_thread(_documentation)
    return {
        "prompts": await _prompts(path, config, source, repeats),
        "conversation": await _conversation(path, config, source, turns),
        "loop": await _loop_while_tokenizing(path, config, source),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument("--output", default="bench-results/tokenize.json")
    args = parser.parse_args(argv)
    results = asyncio.run(measure(args.repeats, args.turns))
    print(f"{'completion prompt':<28}{'new prompt µs':>15}{'sent again µs':>15}")
    for row in results["prompts"]:
        label = f"{row['tokens']:,} tokens"
        print(f"{label:<28}{row['fresh_us']:>15,.0f}{row['again_us']:>15,.0f}")
    conv = results["conversation"]
    print(f"{'conversation turn':<28}{'whole µs':>15}{'resumed µs':>15}")
    for i, turn in enumerate(conv["turns"]):
        if i in (0, 3, 7, len(conv["turns"]) - 1):
            label = f"turn {i + 1} ({turn['tokens']:,} tokens)"
            print(f"{label:<28}{turn['whole_us']:>15,.0f}{turn['resumed_us']:>15,.0f}")
    print(
        f"{len(conv['turns'])} turns in all: whole {conv['whole_ms']:.1f} ms, "
        f"resumed {conv['resumed_ms']:.1f} ms"
    )
    for name, row in results["loop"].items():
        print(
            f"an 8,000-token prompt tokenized {name}: {row['ms']:.1f} ms, "
            f"the loop turned {row['loop_turns']} times"
        )
    save_results(args.output, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
