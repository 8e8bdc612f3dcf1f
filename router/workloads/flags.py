"""The workload flags and the workload they describe.

Shared by ``kvroute bench``, ``kvroute simulate`` and ``kvroute plan``, so that a
simulated run replays exactly what a live one sends: :func:`add_workload_arguments`
defines the flags (docs/benchmarks.md describes each), :func:`build_workload` turns
them into a :class:`Workload` (pure: nothing is sent).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

from router.workloads.ceilings import oracle_hit_rate
from router.workloads.expansion import PromptExpander, trace_specs
from router.workloads.generated import chat_workload, shared_prefix_workload
from router.workloads.spec import RequestSpec
from router.workloads.traces import BUNDLED_TRACES, read_trace, select

GENERATED = ("shared-prefix", "samples", "chat")
#: In-flight limit for trace replay on timestamps: high enough never to hold a request
#: back, bounded so a stalled target cannot make the client open unbounded connections.
TRACE_MAX_IN_FLIGHT = 4_096
DEFAULT_CONCURRENCY = 8


def add_workload_arguments(
    parser: argparse.ArgumentParser, *, trace_alias: bool = False, prompt_format: str = "text"
) -> None:
    """The workload flags on ``parser``; ``trace_alias`` adds ``--trace`` as an alias of
    ``--workload`` (as ``kvroute simulate`` and ``kvroute plan`` have it), and
    ``prompt_format`` is ``--prompt-format``'s default."""
    load = parser.add_argument_group("workload")
    load.add_argument(
        "--workload",
        *(["--trace"] if trace_alias else []),
        dest="workload",
        default="mooncake-conversation",
        metavar="NAME|PATH",
        help=f"{', '.join(BUNDLED_TRACES)}, {', '.join(GENERATED)}, or a trace file "
        "(Mooncake .jsonl or Azure .csv, optionally .gz)",
    )
    load.add_argument("--requests", type=int, metavar="N", help="send at most N requests")
    load.add_argument(
        "--duration",
        type=float,
        metavar="S",
        help="traces: replay only arrivals in the first S seconds (after --speedup); "
        "closed loop: send nothing new after S seconds",
    )
    load.add_argument(
        "--speedup", type=float, default=1.0, help="divide trace arrival times by this"
    )
    load.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="closed loop with N requests (conversations) in flight, ignoring trace "
        f"timestamps (default: traces on their timestamps, generated {DEFAULT_CONCURRENCY})",
    )
    load.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply trace prompt lengths by this (0.125: a 512-token block becomes 64)",
    )
    load.add_argument(
        "--prompt-format",
        choices=["text", "tokens"],
        default=prompt_format,
        help="trace prompts as words or token ids (routers other than kvroute need text)",
    )
    load.add_argument(
        "--max-output-tokens", type=int, metavar="N", help="cap every trace output length"
    )
    load.add_argument("--seed", type=int, default=0, help="seed of every generated prompt")

    multi = parser.add_argument_group("multi-tenant workload (replaces --workload)")
    multi.add_argument(
        "--tenants",
        nargs="+",
        metavar="NAME:rate=R[,...]",
        help="tenants sending at once, each NAME:rate=R[,priority=P][,key=KEY][,prompt=N]"
        "[,output=N] (Poisson arrivals at R requests/s for --duration seconds, default 30); "
        "results per tenant: TTFT p50/p99, throughput, refusals",
    )

    gen = parser.add_argument_group("generated workloads (shared-prefix, samples, chat)")
    gen.add_argument(
        "--groups", type=int, default=16, help="shared-prefix: groups; samples: prompts"
    )
    gen.add_argument(
        "--prompts-per-group",
        type=int,
        default=8,
        help="shared-prefix: prompts per group; samples: samples of each prompt",
    )
    gen.add_argument(
        "--prefix-tokens",
        type=int,
        default=2_000,
        help="shared-prefix: shared prefix length; samples: prompt length",
    )
    gen.add_argument("--conversations", type=int, default=32, help="chat: conversations")
    gen.add_argument("--turns", type=int, default=4, help="chat: turns per conversation")
    gen.add_argument(
        "--system-tokens", type=int, default=500, help="chat: system prompt length (shared)"
    )
    gen.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        help="chat: seconds between an answer and the next turn",
    )
    gen.add_argument(
        "--question-tokens", type=int, default=100, help="question length (shared-prefix, chat)"
    )
    gen.add_argument(
        "--output-tokens", type=int, default=64, help="answer length (every generated workload)"
    )
    gen.add_argument(
        "--output-spread",
        type=_spread,
        default=0.0,
        metavar="F",
        help="each answer's length drawn uniformly within --output-tokens x (1 +- F), "
        "F in [0, 1) (default 0: all equal, which keeps requests that start together in "
        "step for ever)",
    )


def _spread(text: str) -> float:
    """``--output-spread``: a fraction in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text}: expected a fraction from 0 up to (not) 1")
    return value


@dataclass(slots=True)
class Workload:
    """The requests to send and how to describe them."""

    title: str
    """A few words for plot titles."""
    description: str
    specs: list[RequestSpec]
    total: int
    """Requests the workload will send (follow-up turns included)."""
    concurrency: int
    info: dict[str, Any] = field(default_factory=dict)


def build_workload(args: argparse.Namespace, compact: bool = False) -> Workload:
    """The workload the flags describe (pure: nothing is sent); ``compact``: token-id
    trace prompts as arrays (see :func:`~router.workloads.expansion.trace_specs`)."""
    closed = args.concurrency or DEFAULT_CONCURRENCY
    spread = f" (+-{args.output_spread:.0%})" if args.output_spread else ""
    if args.workload == "shared-prefix":
        specs = shared_prefix_workload(
            args.groups,
            args.prompts_per_group,
            args.prefix_tokens,
            args.question_tokens,
            args.output_tokens,
            seed=args.seed,
            output_spread=args.output_spread,
        )[: args.requests]
        text = (
            f"shared-prefix: {args.groups} groups x {args.prompts_per_group} prompts, "
            f"{args.prefix_tokens}-token prefix + {args.question_tokens}-token question, "
            f"{args.output_tokens} output tokens{spread}, {len(specs)} requests, "
            f"{closed} in flight"
        )
        title = f"shared-prefix, {args.groups} groups x {args.prompts_per_group}"
        return Workload(title, text, specs, len(specs), closed, {"kind": "shared-prefix"})
    if args.workload == "samples":
        specs = shared_prefix_workload(
            args.groups,
            args.prompts_per_group,
            args.prefix_tokens,
            0,
            args.output_tokens,
            seed=args.seed,
            shuffle=False,
            output_spread=args.output_spread,
        )[: args.requests]
        text = (
            f"samples: {args.groups} prompts of {args.prefix_tokens} tokens, each sampled "
            f"{args.prompts_per_group} times one after another (reinforcement-learning "
            f"rollouts), {args.output_tokens} output tokens{spread}, {len(specs)} requests, "
            f"{closed} in flight"
        )
        title = f"samples, {args.groups} prompts x {args.prompts_per_group}"
        return Workload(title, text, specs, len(specs), closed, {"kind": "samples"})
    if args.workload == "chat":
        specs = chat_workload(
            args.conversations,
            args.turns,
            args.system_tokens,
            args.question_tokens,
            args.output_tokens,
            think_s=args.think_time,
            seed=args.seed,
            output_spread=args.output_spread,
            requests=args.requests,
        )
        planned = args.conversations * args.turns
        total = planned if args.requests is None else max(0, min(planned, args.requests))
        text = (
            f"chat: {args.conversations} conversations x {args.turns} turns, "
            f"{args.system_tokens}-token shared system prompt, {args.question_tokens}-token "
            f"questions, {args.output_tokens}-token answers"
            + spread
            + f", each turn repeating the whole conversation; {closed} conversations in flight"
            + (f"; the first {total} requests" if total < planned else "")
        )
        title = f"chat, {args.conversations} conversations x {args.turns} turns"
        return Workload(title, text, specs, total, closed, {"kind": "chat"})

    trace = read_trace(args.workload)
    timed = args.concurrency is None
    # Closed loop ignores arrival times: there --duration bounds the sending time instead.
    window = args.duration if timed else None
    chosen = select(trace.requests, limit=args.requests, duration=window, speedup=args.speedup)
    if not chosen:
        raise ValueError(f"no request of {trace.name} is left after --requests/--duration")
    expander = PromptExpander(trace.block_tokens, args.scale, args.prompt_format, args.seed)
    specs = list(
        trace_specs(
            chosen,
            expander,
            timed=timed,
            max_output_tokens=args.max_output_tokens,
            compact=compact,
        )
    )
    mean_prompt = fmean(expander.length(r) for r in chosen)
    mean_output = fmean(s.max_tokens for s in specs)
    pacing = (
        f"on the trace's timestamps / {args.speedup:g} ({chosen[-1].at:.0f} s of arrivals)"
        if timed
        else f"closed loop, {closed} in flight"
    )
    oracle = oracle_hit_rate(chosen)
    sent_as = "token ids" if args.prompt_format == "tokens" else "text"
    text = (
        f"{trace.name}: first {len(chosen)} of {len(trace.requests)} requests, {pacing}; "
        f"prompt lengths x{args.scale:g} ({expander.block_len}-token blocks, mean "
        f"{mean_prompt:,.0f} tokens, sent as {sent_as}), mean output {mean_output:.0f} tokens"
    )
    if args.max_output_tokens is not None:
        text += f" (capped at {args.max_output_tokens})"
    if trace.has_prefixes:
        text += f"; blocks reusable with an infinite cache: {oracle:.1%}"
    info = {
        "kind": "trace",
        "trace": trace.name,
        "requests": len(chosen),
        "trace_requests": len(trace.requests),
        "speedup": args.speedup,
        "scale": args.scale,
        "block_tokens": expander.block_len,
        "prompt_format": args.prompt_format,
        "mean_prompt_tokens": mean_prompt,
        "mean_output_tokens": mean_output,
        "timed": timed,
        "oracle_block_hit_rate": oracle if trace.has_prefixes else None,
    }
    title = f"{trace.name}, {len(chosen)} requests, prompts x{args.scale:g}"
    in_flight = TRACE_MAX_IN_FLIGHT if timed else closed
    return Workload(title, text, specs, len(specs), in_flight, info)
