"""Command-line flags of the engine model, shared by ``kvroute engine`` (the emulator),
``kvroute simulate`` and ``kvroute plan``, so an emulated engine and a simulated one are
described by the same words (docs/engine-emulator.md describes each flag)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from router.engine_model.params import DEFAULT_PRESET, PRESETS, EngineParams, preset


def whole_number(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [minimum, maximum], so a bad value is refused
    naming its flag (the settings object it goes into would name its own field)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            raise argparse.ArgumentTypeError(f"expected a whole number {bound}, got {text!r}")
        return value

    return parse


def number(*, above_zero: bool) -> Callable[[str], float]:
    """An argparse type: a finite number above 0 (``above_zero``) or at least 0."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value > 0 if above_zero else value >= 0)):
            bound = "above 0" if above_zero else ">= 0"
            raise argparse.ArgumentTypeError(f"expected a number {bound}, got {text!r}")
        return value

    return parse


def add_model_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Preset, cache geometry, batching, step timing and KV-transfer flags; returns the
    cache group, for commands that add their own cache flags."""
    cache = parser.add_argument_group("engine model")
    cache.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=DEFAULT_PRESET,
        help="starting point for every engine-model setting below",
    )
    cache.add_argument(
        "--block-size", type=whole_number(1), help="tokens per KV block (preset: 16)"
    )
    cache.add_argument("--cache-blocks", type=whole_number(1), help="KV-cache capacity in blocks")
    cache.add_argument(
        "--cpu-offload-blocks",
        type=whole_number(0),
        help="offload tier in blocks (vLLM's CPU offloading, SGLang's HiCache): GPU "
        "evictions are demoted there and published as CPU-tier events (default: 0, none)",
    )
    cache.add_argument(
        "--max-model-len",
        type=whole_number(2),
        help="longest prompt + output in tokens (default: the preset's, capped by the cache)",
    )
    cache.add_argument(
        "--max-num-batched-tokens", type=whole_number(1), help="token budget per step"
    )
    cache.add_argument("--max-num-seqs", type=whole_number(1), help="most sequences in one step")
    timing = parser.add_argument_group("timing (model time)")
    timing.add_argument(
        "--step-overhead-ms", type=number(above_zero=False), help="fixed cost of every step"
    )
    timing.add_argument(
        "--prefill-us-per-token",
        type=number(above_zero=False),
        help="cost per prompt token not served from cache",
    )
    timing.add_argument(
        "--decode-us-per-seq",
        type=number(above_zero=False),
        help="cost per sequence in a decode step",
    )
    timing.add_argument(
        "--decode-ns-per-context-token",
        type=number(above_zero=False),
        help="cost per context token read by decoding sequences",
    )
    transfer = parser.add_argument_group("KV transfer between engines")
    transfer.add_argument(
        "--kv-bytes-per-token",
        type=whole_number(0),
        help="KV-cache bytes per token, for transfer time (preset: 131072)",
    )
    transfer.add_argument(
        "--kv-transfer-bandwidth",
        type=number(above_zero=True),
        help="bytes per second of a KV transfer between engines (preset: 5e10)",
    )
    transfer.add_argument(
        "--kv-hold-timeout",
        type=number(above_zero=False),
        help="model seconds a prefill leg's blocks wait to be pulled (preset: 480)",
    )
    return cache


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def engine_params(args: argparse.Namespace) -> EngineParams:
    """The engine-model settings from the preset and the flags that override it.

    Without ``--max-model-len`` the preset's is used, capped so that one sequence of
    that length fits in the cache (vLLM refuses to start otherwise).
    """
    base = PRESETS[args.preset]
    block_size = base.block_size if args.block_size is None else args.block_size
    blocks = base.num_gpu_blocks if args.cache_blocks is None else args.cache_blocks
    max_len = args.max_model_len
    if max_len is None:
        max_len = min(base.max_model_len, blocks * block_size)
    return preset(
        args.preset,
        block_size=args.block_size,
        num_gpu_blocks=args.cache_blocks,
        num_cpu_blocks=getattr(args, "cpu_offload_blocks", None),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        step_overhead_s=_scaled(args.step_overhead_ms, 1e-3),
        prefill_token_s=_scaled(args.prefill_us_per_token, 1e-6),
        decode_seq_s=_scaled(args.decode_us_per_seq, 1e-6),
        context_token_s=_scaled(args.decode_ns_per_context_token, 1e-9),
        max_model_len=max_len,
        kv_bytes_per_token=args.kv_bytes_per_token,
        kv_transfer_bandwidth=args.kv_transfer_bandwidth,
        kv_hold_timeout_s=args.kv_hold_timeout,
    )
