"""Trace requests expanded into prompts to send.

:class:`PromptExpander` turns hash ids into deterministic words or token ids: an id
always expands to the same block, so equal id prefixes give equal prompt prefixes.
:func:`trace_specs` gives the requests to send for a trace's requests.
"""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache
from typing import Any, Literal

from router.workloads.spec import RequestSpec
from router.workloads.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest

PromptFormat = Literal["text", "tokens"]

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
