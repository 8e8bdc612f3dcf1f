"""The hit rates no router can beat on a workload.

:func:`oracle_hit_rate`: the share of a trace's blocks that repeat an earlier block.
:func:`prefix_ceiling`: the token hit rate an infinite cache would reach on what was
actually sent (:func:`ceiling_of_keys` from block keys).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from router.hashing import block_keys, cacheable_blocks
from router.workloads.traces import TraceRequest


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
