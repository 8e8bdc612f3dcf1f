"""Deterministic "sampling": the output tokens of a prompt are a function of the prompt.

The same prompt yields the same answer on every engine and in every run, so a client
that appends the answer to a conversation sends exactly the tokens an engine cached,
and tests can predict outputs without a model.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import xxhash

from router.hashing import tokens_to_bytes

_MASK64 = (1 << 64) - 1


def output_token_ids(
    prompt_token_ids: Sequence[int], count: int, vocabulary: Sequence[int], seed: int = 0
) -> list[int]:
    """``count`` token ids drawn from ``vocabulary`` by a PRNG seeded with the prompt.

    ``seed`` separates choices that share a prompt (``n > 1``, or a request ``seed``);
    seed 0 gives the answer of a plain single-choice request.
    """
    key = xxhash.xxh3_64_intdigest(tokens_to_bytes(prompt_token_ids), seed & _MASK64)
    rng = random.Random(key)
    return rng.choices(vocabulary, k=count)
