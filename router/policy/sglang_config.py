"""The parameters of the ``cache_aware_sglang`` policy (router/policy/sglang.py): the
``policy.sglang`` section of the configuration."""

from __future__ import annotations

from pydantic import Field

from router.config_section import Section


class SGLangCacheAwareConfig(Section):
    """sglang-router's ``cache_aware`` rule (defaults are its CLI defaults, 0.3.x)."""

    cache_threshold: float = Field(0.3, ge=0, le=1)
    balance_abs_threshold: int = Field(64, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=1)
    max_tree_size: int = Field(
        2**26, gt=0, description="Tokens per engine tree before LRU eviction."
    )
    eviction_interval_s: float = Field(60.0, gt=0)
