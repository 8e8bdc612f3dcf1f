"""Generated workloads: shared-prefix groups, samples of one prompt, and multi-turn
conversations whose next turn is built from the previous answer
(:attr:`~router.workloads.spec.RequestSpec.then`)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from router.workloads.spec import RequestSpec


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
