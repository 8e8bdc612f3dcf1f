"""Read load signals from engines' Prometheus ``/metrics`` text.

Only a handful of gauges matter, so lines are matched by name prefix instead of running
a full exposition parser (prometheus_client's parser costs milliseconds per vLLM
scrape, this a fraction of one). Both vLLM and SGLang names are understood. With
data-parallel ranks, vLLM labels each series with ``engine="<rank>"``; unlabelled
series belong to rank 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

#: metric name -> field of :class:`EngineSample`
_GAUGES = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "sglang:num_queue_reqs": "waiting",
    "sglang:num_running_reqs": "running",
    "sglang:token_usage": "kv_usage",
}
_NAMES = tuple(_GAUGES)
_RANK = re.compile(r'(?:^|[{,])engine="(\d+)"')
_CACHE_CONFIG = ("vllm:cache_config_info", "sglang:cache_config_info")
_BLOCK_SIZE = re.compile(r'(?:block_size|page_size)="(\d+)"')


@dataclass(slots=True)
class EngineSample:
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None


@dataclass(slots=True)
class Scrape:
    """One parsed scrape: samples per DP rank, and the block size if advertised."""

    ranks: dict[int, EngineSample] = field(default_factory=dict)
    block_size: int | None = None
    sglang: bool = False
    """The engine exports SGLang's metrics (``sglang:...``): it picks a data-parallel
    rank from the request body's ``data_parallel_rank``, not vLLM's header."""


def parse_metrics(text: str) -> Scrape:
    out = Scrape()
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        if line.startswith(_NAMES):
            brace = line.find("{")
            name = line[:brace] if brace != -1 else line.split(" ", 1)[0]
            attr = _GAUGES.get(name)
            if attr is None:
                continue
            rank = 0
            if brace != -1:
                m = _RANK.search(line, brace, line.rfind("}"))
                if m:
                    rank = int(m.group(1))
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            sample = out.ranks.setdefault(rank, EngineSample())
            previous = getattr(sample, attr)
            setattr(sample, attr, value if previous is None else previous + value)
        elif line.startswith(_CACHE_CONFIG):
            m = _BLOCK_SIZE.search(line)
            if m:
                out.block_size = int(m.group(1))
            if line.startswith("sglang:"):
                out.sglang = True
    return out
