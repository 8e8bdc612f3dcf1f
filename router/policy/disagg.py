"""Whether disaggregation pays for one request: a pure function with its reason.

The decode engine is chosen first (by load, with its match depth in view, like llm-d);
then the request is split only if moving its prefill to a prefill engine is worth it:

1. no healthy prefill engine                                  -> local (``no_prefill_engine``)
2. fewer than ``min_prefill_engines`` prefill engines          -> local (``prefill_pool_small``)
3. every prefill engine is behind a link slower than
   ``min_link_bandwidth_gb_s``                                 -> local (``slow_link``)
4. the decode engine already holds ``decode_hit_ratio`` of it  -> local (``decode_holds_prefix``)
5. fewer than ``min_uncached_tokens`` are missing there       -> local (``short_uncached``)
6. moving the KV costs more than the prefill it saves there    -> local (``transfer_costs_more``)
7. otherwise                                                  -> split (``split``)

"Saved" is the prefill the decode engine no longer does, ``uncached x
prefill_s_per_token``: time its decoding requests would otherwise share with a prefill.
"Cost" is the handoff: ``uncached x kv_bytes_per_token / bandwidth`` plus a fixed
``handoff_overhead_s`` for the extra leg. With the defaults (an 8B model, 100 Gb/s) a
token's KV moves in ~10 µs and its prefill takes ~50 µs, so the threshold decides for
short prompts and the ratio test matters on slow links (at 1 GB/s a token's KV takes
131 µs: nothing pays).

With engine topology known (:mod:`router.topology`), the link is the best one from the
decode engine to a prefill engine it may pair with: its locality's bandwidth, fixed
latency and split threshold (``disaggregation.links.*``); without it, every pair shares
the one link of ``transfer_bandwidth_gb_s``, and the decision is what it always was.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.config import DisaggregationConfig
from router.topology import Link, default_link


@dataclass(slots=True, frozen=True)
class SplitDecision:
    split: bool
    reason: str
    uncached_tokens: int
    """Prompt tokens the decode engine does not hold."""
    transfer_s: float
    saved_s: float
    link: str = ""
    """Locality of the link priced (:mod:`router.topology`; ``unknown`` without topology)."""


def decide_split(
    prompt_tokens: int,
    decode_cached_tokens: int,
    have_prefill_engine: bool,
    cfg: DisaggregationConfig,
    *,
    link: Link | None = None,
    prefill_engines: int | None = None,
) -> SplitDecision:
    """Split this request into a prefill leg and a decode leg, or serve it on one engine.

    ``link``: the best link from the decode engine to a prefill engine (default: the
    one of ``transfer_bandwidth_gb_s``); ``prefill_engines``: how many healthy prefill
    engines there are (for ``min_prefill_engines``).
    """
    link = link or default_link(cfg)
    uncached = max(prompt_tokens - decode_cached_tokens, 0)
    transfer_s = link.transfer_s(uncached, cfg)
    saved_s = uncached * cfg.prefill_s_per_token
    if not have_prefill_engine:
        reason = "no_prefill_engine"
    elif prefill_engines is not None and prefill_engines < cfg.min_prefill_engines:
        reason = "prefill_pool_small"
    elif not link.fast_enough(cfg):
        reason = "slow_link"
    elif prompt_tokens and decode_cached_tokens >= cfg.decode_hit_ratio * prompt_tokens:
        reason = "decode_holds_prefix"
    elif uncached < link.min_uncached_tokens:
        reason = "short_uncached"
    elif transfer_s >= saved_s:
        reason = "transfer_costs_more"
    else:
        return SplitDecision(True, "split", uncached, transfer_s, saved_s, link.locality)
    return SplitDecision(False, reason, uncached, transfer_s, saved_s, link.locality)
