"""Command-line flags of the engine model, shared by ``kvroute engine`` (the emulator),
``kvroute simulate`` and ``kvroute plan``, so an emulated engine and a simulated one are
described by the same words (docs/engine-emulator.md describes each flag)."""

from __future__ import annotations

import argparse

from router.engine_model.params import DEFAULT_PRESET, PRESETS, EngineParams, preset


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
    cache.add_argument("--block-size", type=int, help="tokens per KV block (preset: 16)")
    cache.add_argument("--cache-blocks", type=int, help="KV-cache capacity in blocks")
    cache.add_argument(
        "--cpu-offload-blocks",
        type=int,
        help="offload tier in blocks (vLLM's CPU offloading, SGLang's HiCache): GPU "
        "evictions are demoted there and published as CPU-tier events (default: 0, none)",
    )
    cache.add_argument(
        "--max-model-len",
        type=int,
        help="longest prompt + output in tokens (default: the preset's, capped by the cache)",
    )
    cache.add_argument("--max-num-batched-tokens", type=int, help="token budget per step")
    cache.add_argument("--max-num-seqs", type=int, help="most sequences in one step")
    timing = parser.add_argument_group("timing (model time)")
    timing.add_argument("--step-overhead-ms", type=float, help="fixed cost of every step")
    timing.add_argument(
        "--prefill-us-per-token", type=float, help="cost per prompt token not served from cache"
    )
    timing.add_argument(
        "--decode-us-per-seq", type=float, help="cost per sequence in a decode step"
    )
    timing.add_argument(
        "--decode-ns-per-context-token",
        type=float,
        help="cost per context token read by decoding sequences",
    )
    transfer = parser.add_argument_group("KV transfer between engines")
    transfer.add_argument(
        "--kv-bytes-per-token",
        type=int,
        help="KV-cache bytes per token, for transfer time (preset: 131072)",
    )
    transfer.add_argument(
        "--kv-transfer-bandwidth",
        type=float,
        help="bytes per second of a KV transfer between engines (preset: 5e10)",
    )
    transfer.add_argument(
        "--kv-hold-timeout",
        type=float,
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
