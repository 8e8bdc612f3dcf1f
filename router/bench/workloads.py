"""Workloads for ``kvroute bench`` and the simulator: traces, expansion, generated requests.

Pure: parsing, expansion, generation and ceilings only (no network, no clock, no event
loop), so the cluster simulator can replay exactly what the live benchmark sends.

* Mooncake traces (JSONL: ``timestamp`` in ms, ``input_length``, ``output_length``,
  ``hash_ids``, one id per 512-token block, chained so that equal leading ids mean equal
  prefixes) and the Azure LLM inference traces (CSV: ``TIMESTAMP, ContextTokens,
  GeneratedTokens``; arrivals and lengths, no prefix information) parse into
  :class:`TraceRequest`; a malformed line raises :class:`TraceError` naming it.
* :class:`PromptExpander` turns hash ids into deterministic words or token ids: an id
  always expands to the same block, so equal id prefixes give equal prompt prefixes.
* Generated workloads: shared-prefix groups, and multi-turn conversations whose next
  turn is built from the previous answer (:attr:`RequestSpec.then`).
* Ceilings: :func:`oracle_hit_rate` (the share of a trace's blocks that repeat an
  earlier block) and :func:`prefix_ceiling` (the token hit rate an infinite cache would
  reach on what was actually sent).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import random
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from router.hashing import block_keys, cacheable_blocks
from router.tokenization.words import WordTokenizer, render_chat

#: Tokens per hash id in the Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512

#: Workload names that refer to the traces shipped in ``router/bench/traces``.
BUNDLED_TRACES = {
    "mooncake-conversation": "conversation_trace.jsonl.gz",
    "mooncake-synthetic": "synthetic_trace.jsonl.gz",
    "azure-code": "AzureLLMInferenceTrace_code.csv.gz",
    "azure-conv": "AzureLLMInferenceTrace_conv.csv.gz",
}

PromptFormat = Literal["text", "tokens"]


@dataclass(slots=True)
class RequestSpec:
    """One request to send."""

    prompt: str | list[int] | array | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int = 16
    group: str = ""
    """A label results are grouped by (a shared-prefix group, a conversation)."""
    at: float | None = None
    """Seconds after the run starts to send it (None: as soon as a slot is free)."""
    extra: dict[str, Any] = field(default_factory=dict)
    then: Callable[[str], RequestSpec | None] | None = None
    """Builds the next request of the same session from this one's answer text."""
    delay: float = 0.0
    """Seconds to wait after the previous request of its session ended (think time)."""


# ------------------------------------------------------------------------------ traces


class TraceError(ValueError):
    """A trace line that cannot be replayed; the message names the source and line."""

    def __init__(self, source: str, line: int, reason: str) -> None:
        super().__init__(f"{source}, line {line}: {reason}")
        self.source = source
        self.line = line
        self.reason = reason


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    at: float
    """Seconds after the trace's first request."""
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    """One id per block of the prompt; equal leading ids mean equal prefixes."""


@dataclass(frozen=True, slots=True)
class Trace:
    """A parsed trace and how to read its hash ids."""

    name: str
    requests: tuple[TraceRequest, ...]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    has_prefixes: bool = True
    """False when the source carries no prefix information (each prompt is unique)."""


class _FreshIds:
    """Negative block ids, unique within one parse, for prompts without ``hash_ids``."""

    def __init__(self) -> None:
        self.next = -1

    def take(self, count: int) -> tuple[int, ...]:
        ids = tuple(range(self.next, self.next - count, -1))
        self.next -= count
        return ids


def _int_field(obj: dict[str, Any], name: str, minimum: int, source: str, line: int) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(source, line, f"{name!r} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(source, line, f"{name!r} must be >= {minimum}, got {value}")
    return value


def parse_mooncake(
    lines: Iterable[str], source: str = "trace", block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> list[TraceRequest]:
    """Parse Mooncake JSONL lines, sorted by arrival (stable); blank lines are skipped.

    ``hash_ids`` must hold ``ceil(input_length / block_tokens)`` ids; without it (AIPerf
    allows that) the prompt is unique and gets fresh negative ids.
    """
    fresh = _FreshIds()
    out: list[TraceRequest] = []
    for number, raw in enumerate(lines, 1):
        text = raw.strip()
        if not text:
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(source, number, f"not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(source, number, "expected a JSON object")
        stamp = obj.get("timestamp", 0)
        if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not stamp >= 0:
            raise TraceError(source, number, f"'timestamp' must be a number >= 0, got {stamp!r}")
        length = _int_field(obj, "input_length", 1, source, number)
        output = _int_field(obj, "output_length", 0, source, number)
        blocks = math.ceil(length / block_tokens)
        ids = obj.get("hash_ids")
        if ids is None:
            hash_ids = fresh.take(blocks)
        else:
            if not isinstance(ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in ids
            ):
                raise TraceError(source, number, "'hash_ids' must be a list of integers")
            if len(ids) != blocks:
                raise TraceError(
                    source,
                    number,
                    f"{len(ids)} hash_ids for input_length {length}: expected {blocks} "
                    f"(one per {block_tokens}-token block)",
                )
            hash_ids = tuple(ids)
        out.append(TraceRequest(stamp / 1000.0, length, output, hash_ids))
    return _from_zero(out)


def _azure_time(text: str) -> float:
    """Seconds since the epoch of ``2023-11-16 18:17:03.9799600`` (7 fraction digits)."""
    whole, _, fraction = text.strip().partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float(f"0.{fraction}") if fraction else 0.0)


def parse_azure(
    lines: Iterable[str], source: str = "trace", block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> list[TraceRequest]:
    """Parse an Azure LLM inference trace (CSV with a header), sorted by arrival.

    The traces hold no prefix information, so every prompt is unique (fresh ids).
    """
    reader = csv.reader(lines)
    header = next(reader, None)
    wanted = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    if header is None or any(name not in header for name in wanted):
        raise TraceError(source, 1, f"expected a header with {', '.join(wanted)}")
    cols = [header.index(name) for name in wanted]
    fresh = _FreshIds()
    out: list[TraceRequest] = []
    for row in reader:
        if not row:
            continue
        number = reader.line_num
        try:
            stamp = _azure_time(row[cols[0]])
            length = int(row[cols[1]])
            output = int(row[cols[2]])
        except (IndexError, ValueError) as exc:
            raise TraceError(source, number, f"bad row {row!r} ({exc})") from None
        if length < 1 or output < 0:
            raise TraceError(source, number, f"lengths out of range in {row!r}")
        ids = fresh.take(math.ceil(length / block_tokens))
        out.append(TraceRequest(stamp, length, output, ids))
    return _from_zero(out)


def _from_zero(requests: list[TraceRequest]) -> list[TraceRequest]:
    requests.sort(key=lambda r: r.at)
    if not requests:
        return requests
    first = requests[0].at
    return [replace(r, at=r.at - first) for r in requests]


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def read_trace(source: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Trace:
    """Read a bundled trace by name (:data:`BUNDLED_TRACES`) or a trace file by path.

    ``.csv`` (optionally ``.gz``) files are Azure traces; anything else is Mooncake JSONL.
    """
    name = str(source)
    if name in BUNDLED_TRACES:
        ref = resources.files("router.bench") / "traces" / BUNDLED_TRACES[name]
        with resources.as_file(ref) as path:
            return _read_path(path, name, block_tokens)
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(
            f"no trace {name!r}: not a file, and not one of {', '.join(BUNDLED_TRACES)}"
        )
    return _read_path(path, path.name, block_tokens)


def _read_path(path: Path, name: str, block_tokens: int) -> Trace:
    azure = path.name.removesuffix(".gz").endswith(".csv")
    with _open_text(path) as f:
        if azure:
            return Trace(name, tuple(parse_azure(f, name, block_tokens)), block_tokens, False)
        return Trace(name, tuple(parse_mooncake(f, name, block_tokens)), block_tokens, True)


def select(
    requests: Sequence[TraceRequest],
    *,
    limit: int | None = None,
    duration: float | None = None,
    speedup: float = 1.0,
) -> list[TraceRequest]:
    """The requests to replay: arrivals compressed by ``speedup``, only those arriving
    within ``duration`` replay seconds, at most the first ``limit``."""
    if speedup <= 0:
        raise ValueError("speedup must be positive")
    out: list[TraceRequest] = []
    for r in requests:
        at = r.at / speedup
        if duration is not None and at > duration:
            break
        if limit is not None and len(out) >= limit:
            break
        out.append(replace(r, at=at))
    return out


# ------------------------------------------------------------------------------ expansion

# Common English words that are one token (after a space) in the usual BPE vocabularies
# (Llama 3, Qwen, GPT-4) and exactly one token for the emulator's word tokenizer, so a
# text prompt of N words is about N tokens on a real engine too.
_WORDS = tuple(
    """
    the of and to in is was for on are with as by at be this from have or had not but
    what all were when we there can an your which their said if do will each about how
    up out them then she many some so these would other into has more her two like him
    see time could no make than first been its who now people my made over did down only
    way find use may water long little very after words called just where most know get
    through back much go good new write our me man too any day same right look think also
    around another came come work three word must because does part even place well such
    here take why things help put years different away again off went old number great
    tell men say small every found still between name should home big give air line set
    own under read last never us left end along while might next sound below saw something
    thought both few those always looked show large often together asked house world going
    want school important until form food keep children feet land side without boy once
    animals life enough took sometimes four head above kind began almost live page got
    earth need far hand high year mother light parts country father let night following
    picture being study second eyes soon times story boys since white days ever paper hard
    near sentence better best across during today others however sure means knew try told
    young miles sun ways thing whole hear example heard several change answer room sea
    against top turned learn point city play toward five using himself usually money
    """.split()
)
_TOKEN_IDS = range(1_024, 32_000)
"""Token ids drawn for ``tokens`` prompts: valid in every common vocabulary (32k and up)
and clear of the low ids where vocabularies keep special tokens."""


class PromptExpander:
    """Expands trace requests into prompts; deterministic for a given ``seed``.

    Each hash id becomes one block of ``round(block_tokens * scale)`` words (``text``) or
    token ids (``tokens``) drawn from a PRNG seeded with the id, and a prompt is its
    blocks cut at ``round(input_length * scale)``. Equal id prefixes therefore give equal
    prompt prefixes, and different ids give different blocks (two 16-token stretches
    drawn from a few hundred words agree with negligible probability). ``scale`` below
    1 shrinks prompts so a small machine can keep up.
    """

    def __init__(
        self,
        block_tokens: int = MOONCAKE_BLOCK_TOKENS,
        scale: float = 1.0,
        prompt_format: PromptFormat = "text",
        seed: int = 0,
    ) -> None:
        if scale <= 0:
            raise ValueError("scale must be positive")
        if prompt_format not in ("text", "tokens"):
            raise ValueError(f"prompt format must be 'text' or 'tokens', not {prompt_format!r}")
        self.scale = scale
        self.prompt_format = prompt_format
        self.seed = seed
        self.block_len = max(1, round(block_tokens * scale))
        # Bounded: a full trace at scale 1 has ~300k distinct ids; recent ones recur most.
        self._block = lru_cache(maxsize=16_384)(self._make_block)

    def _make_block(self, hash_id: int) -> list[Any]:
        rng = random.Random(f"kvroute-block:{self.seed}:{hash_id}")
        population: Sequence[Any] = _WORDS if self.prompt_format == "text" else _TOKEN_IDS
        return rng.choices(population, k=self.block_len)

    def length(self, request: TraceRequest) -> int:
        """Prompt length in tokens after scaling."""
        scaled = max(1, round(request.input_length * self.scale))
        return min(scaled, len(request.hash_ids) * self.block_len)

    def items(self, request: TraceRequest) -> list[Any]:
        """The prompt's words or token ids."""
        n = self.length(request)
        out: list[Any] = []
        for h in request.hash_ids[: math.ceil(n / self.block_len)]:
            out.extend(self._block(h))
        del out[n:]
        return out

    def prompt(self, request: TraceRequest) -> str | list[int]:
        """The prompt as sent: text, or a list of token ids."""
        items = self.items(request)
        return " ".join(items) if self.prompt_format == "text" else items


def trace_specs(
    requests: Iterable[TraceRequest],
    expander: PromptExpander,
    *,
    timed: bool = True,
    max_output_tokens: int | None = None,
    compact: bool = False,
) -> Iterator[RequestSpec]:
    """Requests to send for trace requests (at their arrival times when ``timed``).

    Output lengths are capped at ``max_output_tokens`` and raised to 1 (an engine
    refuses ``max_tokens`` 0). ``compact`` keeps token-id prompts as ``array("I")``
    (4 bytes a token instead of a Python int each): for the simulator, which holds a
    whole trace in memory; such prompts cannot be sent as JSON.
    """
    for r in requests:
        out = r.output_length
        if max_output_tokens is not None:
            out = min(out, max_output_tokens)
        prompt = expander.prompt(r)
        yield RequestSpec(
            prompt=array("I", prompt) if compact and isinstance(prompt, list) else prompt,
            max_tokens=max(1, out),
            at=r.at if timed else None,
        )


# ------------------------------------------------------------------------------ generated


def words(rng: random.Random, count: int, tag: str = "w") -> str:
    """``count`` pseudo-random words; the emulator's tokenizer makes each one token."""
    return " ".join(f"{tag}{rng.getrandbits(40):x}" for _ in range(count))


def answer_lengths(max_tokens: int, spread: float, count: int, seed: str) -> list[int]:
    """``count`` answer lengths: ``max_tokens`` each, or with ``spread`` > 0 each drawn
    uniformly from ``max_tokens * (1 +- spread)`` (seeded by ``seed``, apart from the
    prompts' own draws, so the prompts do not depend on the spread)."""
    if not 0.0 <= spread < 1.0:
        raise ValueError(f"output_spread must be in [0, 1), not {spread}")
    if not spread:
        return [max_tokens] * count
    draw = random.Random(seed)
    return [
        max(1, round(max_tokens * (1 + spread * draw.uniform(-1.0, 1.0)))) for _ in range(count)
    ]


def shared_prefix_workload(
    groups: int,
    per_group: int,
    prefix_tokens: int,
    question_tokens: int,
    max_tokens: int,
    seed: int = 0,
    shuffle: bool = True,
    output_spread: float = 0.0,
) -> list[RequestSpec]:
    """Groups of prompts that share a long prefix and end in distinct questions; with
    ``question_tokens`` 0 a group is one prompt asked ``per_group`` times (n samples of
    one prompt, as reinforcement-learning rollouts send them). ``shuffle`` mixes the
    groups; unshuffled, each group's prompts are sent one after another.
    ``output_spread``: as :func:`chat_workload`'s."""
    rng = random.Random(seed)
    specs = []
    for g in range(groups):
        prefix = words(rng, prefix_tokens, f"g{g}x")
        lengths = answer_lengths(max_tokens, output_spread, per_group, f"{seed}:answers:{g}")
        for length in lengths:
            prompt = f"{prefix} {words(rng, question_tokens, 'q')}" if question_tokens else prefix
            specs.append(RequestSpec(prompt=prompt, max_tokens=length, group=f"group-{g}"))
    if shuffle:
        rng.shuffle(specs)
    return specs


def next_turn(
    messages: Sequence[dict[str, Any]], answer: str, question: str
) -> list[dict[str, Any]]:
    """The next turn of a chat: the conversation so far, the answer, then a new question."""
    return [
        *messages,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": question},
    ]


def _chat_turn(
    messages: list[dict[str, Any]],
    questions: Sequence[str],
    turn: int,
    lengths: Sequence[int],
    group: str,
    think_s: float,
) -> RequestSpec:
    def then(answer: str) -> RequestSpec | None:
        if turn + 1 >= len(questions):
            return None
        following = next_turn(messages, answer, questions[turn + 1])
        return _chat_turn(following, questions, turn + 1, lengths, group, think_s)

    return RequestSpec(
        messages=messages,
        max_tokens=lengths[turn],
        group=group,
        delay=think_s if turn else 0.0,
        then=then,
    )


def chat_workload(
    conversations: int,
    turns: int,
    system_tokens: int,
    question_tokens: int,
    max_tokens: int,
    think_s: float = 0.0,
    seed: int = 0,
    output_spread: float = 0.0,
    requests: int | None = None,
) -> list[RequestSpec]:
    """Multi-turn conversations, one first turn each; later turns follow from answers.

    Every conversation starts with the same system prompt (one application's) and its
    own question; each next turn appends the previous answer and a new question, so it
    repeats the whole conversation so far (a prefix an engine may still hold). Answers
    are ``max_tokens`` long, or with ``output_spread`` > 0 each drawn uniformly from
    ``max_tokens * (1 +- output_spread)`` (seeded per conversation; the prompts are those
    of ``output_spread`` 0): equal lengths and no think time keep conversations that
    start together in step for ever, which real answers do not.

    ``requests`` caps the requests of all conversations together: the first ones in
    order, whole, and the last one cut short (the same prompts as without the cap).
    """
    rng = random.Random(seed)
    system = words(rng, system_tokens, "sys")
    specs = []
    for c in range(conversations):
        kept = turns if requests is None else min(turns, requests - c * turns)
        if kept <= 0:
            break
        questions = [words(rng, question_tokens, f"c{c}t{t}q") for t in range(turns)]
        lengths = answer_lengths(max_tokens, output_spread, turns, f"{seed}:answers:{c}")
        first = [{"role": "system", "content": system}, {"role": "user", "content": questions[0]}]
        specs.append(
            _chat_turn(first, questions[:kept], 0, lengths[:kept], f"conversation-{c}", think_s)
        )
    return specs


# ------------------------------------------------------------------------------ ceilings


def oracle_hit_rate(requests: Iterable[TraceRequest]) -> float:
    """The share of blocks that repeat an earlier block: the hit rate an infinite cache
    reaches on the trace, counted in trace blocks (36.6% for the Mooncake conversation
    trace)."""
    seen: set[int] = set()
    total = repeated = 0
    for r in requests:
        for h in r.hash_ids:
            total += 1
            if h in seen:
                repeated += 1
            else:
                seen.add(h)
    return repeated / total if total else 0.0


_tokenizer = WordTokenizer()


def spec_tokens(spec: RequestSpec) -> list[int]:
    """The prompt token ids an emulated engine sees for ``spec`` (word tokenizer)."""
    if spec.messages is not None:
        return _tokenizer.encode(render_chat(spec.messages))
    if isinstance(spec.prompt, str):
        return _tokenizer.encode(spec.prompt)
    return list(spec.prompt or [])


def answer_tokens(text: str) -> list[int]:
    """The token ids of an answer, as the emulator generated them."""
    return _tokenizer.encode(text)


def prefix_ceiling(
    sequences: Iterable[tuple[Sequence[int], Sequence[int]]], block_size: int
) -> float:
    """The token hit rate of one engine with an infinite prefix cache.

    ``sequences`` are (prompt tokens, answer tokens) in arrival order. Hits are counted
    as vLLM counts them: whole blocks from the start that an earlier request computed
    (its prompt and its answer but the last token), never the prompt's last token.
    """
    return ceiling_of_keys(
        (
            (
                block_keys(prompt, block_size, 0),
                len(prompt),
                _computed_keys(prompt, answer, block_size),
            )
            for prompt, answer in sequences
        ),
        block_size,
    )


def _computed_keys(prompt: Sequence[int], answer: Sequence[int], block_size: int) -> list[int]:
    return block_keys([*prompt, *answer[:-1]], block_size, 0) if len(answer) > 1 else []


def ceiling_of_keys(
    sequences: Iterable[tuple[Sequence[int], int, Sequence[int]]], block_size: int
) -> float:
    """:func:`prefix_ceiling` from block keys, for callers that keep keys, not tokens:
    (the prompt's full-block keys, its length in tokens, the keys of the blocks its answer
    adds or ``[]``) in arrival order, all chained from one seed."""
    seen: set[int] = set()
    queried = hit = 0
    for keys, length, computed in sequences:
        depth = 0
        for key in keys[: cacheable_blocks(length, block_size)]:
            if key not in seen:
                break
            depth += 1
        queried += length
        hit += depth * block_size
        seen.update(keys)
        seen.update(computed)
    return hit / queried if queried else 0.0
