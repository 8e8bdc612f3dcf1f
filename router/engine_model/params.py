"""Capacity and timing parameters of an emulated engine, with named presets.

One frozen object holds everything that shapes an engine's behaviour, so the real-time
emulator and the cluster simulator build identical engines from the same settings.

The default preset, ``h100-8b``, is an order-of-magnitude model of an 8B-parameter
dense model in BF16 on one H100 80 GB (Llama-3.1-8B class); docs/engine-emulator.md
derives each number. Times are in seconds of model time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineParams:
    """Cache geometry, batching limits and the step-time model of one engine.

    Step time (one forward pass over the batch)::

        step = step_overhead_s
             + prefill_tokens x prefill_token_s
             + decode_seqs x decode_seq_s
             + context_tokens_of_decode_seqs x context_token_s

    KV transfer between engines (disaggregated prefill and decode)::

        transfer = tokens x kv_bytes_per_token / kv_transfer_bandwidth
    """

    block_size: int = 16
    #: KV-cache capacity in blocks (vLLM's ``num_gpu_blocks``).
    num_gpu_blocks: int = 27_648
    #: Offload tier in blocks (vLLM's CPU offloading, ``--kv-offloading-size``; SGLang's
    #: HiCache host pool): a block evicted from the GPU cache is demoted here instead of
    #: forgotten, and a later prefix hit on it loads it back instead of recomputing it.
    #: 0: no offload tier.
    num_cpu_blocks: int = 0
    #: Token budget of one step, shared by prefill chunks and decodes.
    max_num_batched_tokens: int = 8_192
    max_num_seqs: int = 256
    max_model_len: int = 131_072
    #: Fixed cost of every step: reading the weights once, launches, scheduling.
    step_overhead_s: float = 0.005
    #: Compute cost of each prompt token processed (not served from cache).
    prefill_token_s: float = 50e-6
    #: Per-sequence cost of a decode step (sampling, per-row work).
    decode_seq_s: float = 60e-6
    #: Cost of reading one context token's KV during decode (memory bandwidth).
    context_token_s: float = 40e-9
    #: Size of one token's KV cache (all layers, K and V), for KV-transfer time.
    kv_bytes_per_token: int = 131_072
    #: Bytes per second of the link a KV transfer between two engines uses.
    kv_transfer_bandwidth: float = 50e9
    #: How long a prefill-only request's blocks stay pinned for a remote decode engine
    #: (vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``).
    kv_hold_timeout_s: float = 480.0

    def __post_init__(self) -> None:
        for name in ("block_size", "num_gpu_blocks", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.max_model_len > self.num_gpu_blocks * self.block_size:
            raise ValueError(
                f"max_model_len {self.max_model_len} does not fit in the KV cache "
                f"({self.num_gpu_blocks} blocks x {self.block_size} tokens)"
            )
        for name in (
            "step_overhead_s",
            "prefill_token_s",
            "decode_seq_s",
            "context_token_s",
            "kv_bytes_per_token",
            "kv_hold_timeout_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if not self.kv_transfer_bandwidth > 0:
            raise ValueError(
                f"kv_transfer_bandwidth must be positive, got {self.kv_transfer_bandwidth}"
            )

    def transfer_time(self, num_tokens: int, bandwidth: float | None = None) -> float:
        """Model seconds to move ``num_tokens`` tokens of KV cache between two engines
        (over ``bandwidth`` bytes per second; default ``kv_transfer_bandwidth``)."""
        return num_tokens * self.kv_bytes_per_token / (bandwidth or self.kv_transfer_bandwidth)

    def replace(self, **changes: Any) -> EngineParams:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


#: Named starting points; individual fields can still be overridden.
PRESETS: dict[str, EngineParams] = {
    "h100-8b": EngineParams(),
    # The geometry of Dynamo's mocker engine, to compare against its published runs.
    "dynamo-mocker": EngineParams(
        block_size=64,
        num_gpu_blocks=16_384,
        max_num_batched_tokens=8_192,
        max_num_seqs=256,
    ),
}
DEFAULT_PRESET = "h100-8b"


def preset(name: str, **overrides: Any) -> EngineParams:
    """The parameters of preset ``name`` with ``overrides`` applied (None values ignored)."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
    changes = {k: v for k, v in overrides.items() if v is not None}
    return base.replace(**changes) if changes else base
