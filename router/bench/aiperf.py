"""``make bench-aiperf``: the Mooncake replay driven by NVIDIA AIPerf through kvroute.

AIPerf (installed from PyPI into its own virtualenv under ``build/aiperf``; never a
kvroute dependency) replays a reduced Mooncake conversation trace on its timestamps
(``--custom-dataset-type mooncake_trace --fixed-schedule``) against ``kvroute serve``
with its default policy and with round robin, each in front of fresh emulated engines.
Beside AIPerf's client-side TTFT, ITL and throughput this prints the engines' own
prefix-cache hit rates (read from their ``/metrics`` before and after each run), then
the same numbers from ``kvroute bench`` on the same requests, so the two tools can be
read side by side.

AIPerf builds prompts from a Hugging Face tokenizer it resolves through the Hugging
Face cache, offline here (``HF_HUB_OFFLINE=1``). The tokenizer this module lays out
there is the emulator's: one whitespace-separated word is one token (a word-level
vocabulary of AIPerf's own prompt corpus), so AIPerf's ``hash_id`` blocks of N tokens
are N emulator tokens and its prompt lengths are the lengths ``kvroute bench`` sends.

When AIPerf cannot be installed the reason goes to ``build/aiperf/UNAVAILABLE`` and
the benchmark is skipped with it (exit status 0); ``rm -r build/aiperf`` to try again.
Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router.bench.runner import EngineSnapshot, parse_engine_metrics
from router.bench.targets import Stack, StackOptions, http_get, parse_target
from router.emulator.compat import install_into
from router.workloads.ceilings import oracle_hit_rate
from router.workloads.expansion import PromptExpander
from router.workloads.stats import latency_stats
from router.workloads.tables import render_markdown, render_text
from router.workloads.traces import TraceRequest, read_trace, select

AIPERF_SPEC = "aiperf==0.13.0"
BUILD = Path("build/aiperf")
#: The served model name and the tokenizer's hub id: AIPerf wants ``ORG/NAME`` for both.
MODEL = "kvroute/emulated-words"
#: Targets of both tools, each on fresh engines.
TARGETS = ("kvroute=policy:default", "rr=policy:round_robin")
ENGINES = 4
#: As ``make bench-compare``: prefill twice the preset's, so shortened prompts still load
#: the engines.
ENGINE_ARGS = ("--prefill-us-per-token", "100", "--model", MODEL)
UNK = "[UNK]"


@dataclass(frozen=True)
class Replay:
    """The reduced trace both tools send (the selection ``kvroute bench`` makes)."""

    trace: str = "mooncake-conversation"
    requests: int = 400
    speedup: float = 8.0
    scale: float = 0.0625
    max_output_tokens: int = 128

    def bench_args(self) -> list[str]:
        """The ``kvroute bench`` workload flags that select the same requests."""
        return [
            "--workload",
            self.trace,
            "--requests",
            str(self.requests),
            "--speedup",
            f"{self.speedup:g}",
            "--scale",
            f"{self.scale:g}",
            "--max-output-tokens",
            str(self.max_output_tokens),
        ]


# ----------------------------------------------------------------- installing AIPerf


def install(
    build_dir: Path, spec: str = AIPERF_SPEC, command: str = "aiperf"
) -> tuple[Path | None, str]:
    """``command`` of ``spec`` in ``build_dir/venv`` (installed if needed), or None and
    the reason it cannot be installed (also written to ``build_dir/UNAVAILABLE``, which
    later runs read instead of trying again)."""
    unavailable = build_dir / "UNAVAILABLE"
    if unavailable.exists():
        return None, unavailable.read_text().strip()
    build_dir.mkdir(parents=True, exist_ok=True)
    executable, why = install_into(build_dir / "venv", spec, command)
    if executable is None:
        unavailable.write_text(why + "\n")
    return executable, why


# ------------------------------------------------------- the tokenizer as an HF cache entry


def word_tokenizer_files(words: Iterable[str]) -> dict[str, str]:
    """``tokenizer.json``, ``tokenizer_config.json`` and ``config.json`` of a word-level
    tokenizer that splits on whitespace only, as the emulator does: every word of
    ``words`` is one token, any other word is ``[UNK]`` (also one token). Without a
    decoder, decoding joins tokens with single spaces, so a decoded prompt of N tokens is
    N words for the emulator. No BOS or EOS token: AIPerf would insert it between blocks.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {UNK: 0}
    for word in words:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNK,
        # Keep " ," as it is: the emulator counts it as its own word.
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
    }
    config = {"model_type": "llama", "vocab_size": len(vocab)}
    return {
        "tokenizer.json": tok.to_str(),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2),
        "config.json": json.dumps(config, indent=2),
    }


def corpus_words(text: str) -> list[str]:
    """The distinct whitespace-separated words of ``text``, in order of appearance."""
    return list(dict.fromkeys(text.split()))


def revision_of(files: Mapping[str, str]) -> str:
    """A 40-hex revision name for ``files``: the SHA-1 of their names and contents, so
    the same files get the same snapshot and changed files a new one."""
    digest = hashlib.sha1()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name].encode() + b"\0")
    return digest.hexdigest()


def hf_cache_entry(hf_home: Path, repo_id: str, files: Mapping[str, str]) -> Path:
    """Lay ``files`` out as the Hugging Face cache entry of ``repo_id`` under
    ``hf_home``: ``hub/models--ORG--NAME/snapshots/<revision>/FILE`` and
    ``refs/main`` naming the revision, which is how ``from_pretrained(repo_id)`` finds
    a model offline. Returns the snapshot directory."""
    org, sep, name = repo_id.partition("/")
    if not sep or not org or not name or "/" in name:
        raise ValueError(f"repo id must be ORG/NAME, got {repo_id!r}")
    repo = hf_home / "hub" / f"models--{org}--{name}"
    revision = revision_of(files)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for filename, content in files.items():
        (snapshot / filename).write_text(content)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def aiperf_corpus(venv: Path) -> Path | None:
    """AIPerf's prompt corpus inside its virtualenv (None if this version has none)."""
    found = sorted(venv.glob("lib/python*/site-packages/aiperf/dataset/generator/assets/*.txt"))
    return found[0] if found else None


# --------------------------------------------------------------------- the trace file


def trace_lines(
    requests: Sequence[TraceRequest], expander: PromptExpander, max_output_tokens: int | None
) -> list[str]:
    """AIPerf ``mooncake_trace`` lines for ``requests`` as ``kvroute bench`` sends them:
    timestamps in ms (already divided by the speedup), prompt lengths after scaling,
    one ``hash_id`` per ``expander.block_len`` tokens (send with
    ``--isl-block-size expander.block_len``) and outputs capped."""
    lines = []
    for r in requests:
        length = expander.length(r)
        output = (
            r.output_length
            if max_output_tokens is None
            else min(r.output_length, max_output_tokens)
        )
        record = {
            "timestamp": round(r.at * 1000),
            "input_length": length,
            "output_length": max(1, output),
            "hash_ids": list(r.hash_ids[: math.ceil(length / expander.block_len)]),
        }
        lines.append(json.dumps(record))
    return lines


# ----------------------------------------------------------------- reading AIPerf's results

#: AIPerf latency metric tag -> row label. AIPerf's ``inter_token_latency`` is each
#: request's mean gap ((end-to-end - TTFT) / (output tokens - 1)), its distribution over
#: requests; ``inter_chunk_latency`` is every gap between two streamed chunks, which is
#: what ``kvroute bench`` calls inter-token latency (the emulator streams one token per
#: chunk).
METRICS = {
    "time_to_first_token": "TTFT",
    "inter_token_latency": "ITL (per-request mean)",
    "inter_chunk_latency": "ITL (every gap)",
    "request_latency": "end-to-end",
}
STATS = ("avg", "p50", "p90", "p99")


def parse_export(document: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers this benchmark compares from AIPerf's ``profile_export_aiperf.json``:
    latencies in seconds (AIPerf reports milliseconds) as ``{"mean", "p50", "p90",
    "p99"}``, throughputs per second, request and error counts, and the hit rate of the
    answers' usage (``cached_tokens`` / ``prompt_tokens``)."""

    def metric(tag: str) -> Mapping[str, Any]:
        value = document.get(tag)
        return value if isinstance(value, Mapping) else {}

    out: dict[str, Any] = {}
    for tag in METRICS:
        m = metric(tag)
        scale = 1e-3 if m.get("unit", "ms") == "ms" else 1.0
        out[tag] = {
            ("mean" if s == "avg" else s): (float(m[s]) * scale if m.get(s) is not None else None)
            for s in STATS
        }
    for tag in ("request_throughput", "output_token_throughput"):
        avg = metric(tag).get("avg")
        out[tag] = float(avg) if avg is not None else None
    count = metric("request_count").get("avg")
    out["requests"] = int(count) if count is not None else None
    errors = metric("error_request_count").get("avg")
    if errors is None:
        summary = document.get("error_summary") or []
        errors = sum(int(e.get("count", 1)) for e in summary if isinstance(e, Mapping))
    out["errors"] = int(errors)
    cached = metric("overall_usage_prompt_cache_read_pct").get("avg")
    out["hit_rate_client"] = float(cached) / 100 if cached is not None else None
    return out


def hit_rate(before: Sequence[EngineSnapshot], after: Sequence[EngineSnapshot]) -> float | None:
    """Δ prefix-cache hits / Δ queries summed over the engines (None if unreadable)."""
    if not before or not all(s.ok for s in [*before, *after]):
        return None
    queries = sum(a.queries - b.queries for a, b in zip(after, before, strict=True))
    hits = sum(a.hits - b.hits for a, b in zip(after, before, strict=True))
    return hits / queries if queries > 0 else None


def _snapshot(urls: Sequence[str]) -> list[EngineSnapshot]:
    out = []
    for url in urls:
        status, text = http_get(f"{url}/metrics", timeout=5.0)
        out.append(
            parse_engine_metrics(text, 0.0) if status == 200 else EngineSnapshot(0.0, ok=False)
        )
    return out


# ------------------------------------------------------------------------ the tables


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1000
    return f"{ms:,.2f} ms" if ms < 10 else f"{ms:,.1f} ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _count(value: float | None) -> str:
    return _num(value, 0)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


Show = Callable[[float | None], str]

#: The rows of both tables: (label, key, statistic or None, format).
ROWS: list[tuple[str, str, str | None, Show]] = [
    ("requests answered", "requests", None, _count),
    ("errors", "errors", None, _count),
    ("prefix-cache hit rate (engines)", "hit_rate", None, _pct),
    ("hit rate (answers' usage)", "hit_rate_client", None, _pct),
    *(
        (f"{label} {stat}", tag, stat, _ms)
        for tag, label in METRICS.items()
        for stat in ("mean", "p50", "p90", "p99")
        if tag == "time_to_first_token" or stat in ("p50", "p99")
    ),
    ("throughput, requests/s", "request_throughput", None, _num),
    ("throughput, output tokens/s", "output_token_throughput", None, _num),
]


def _value(numbers: Mapping[str, Any], key: str, stat: str | None) -> float | None:
    value = numbers.get(key)
    if stat is not None:
        value = (value or {}).get(stat)
    return None if value is None else float(value)


def aiperf_rows(runs: Mapping[str, Mapping[str, Any]], baseline: str) -> list[list[str]]:
    """AIPerf's numbers per target beside the engines' hit rates, with each target's
    ratio to ``baseline`` (its value over the baseline's)."""
    names = list(runs)
    others = [n for n in names if n != baseline]
    rows = [["metric", *names, *(f"{n}/{baseline}" for n in others)]]
    for label, key, stat, show in ROWS:
        values = {n: _value(runs[n], key, stat) for n in names}
        ratios = [_ratio(values[n], values[baseline]) for n in others]
        rows.append([label, *(show(values[n]) for n in names), *ratios])
    return rows


def bench_summary(target: Mapping[str, Any]) -> dict[str, Any]:
    """A ``kvroute bench`` target summary (results.json) in :func:`parse_export`'s shape;
    the per-request mean ITL, which bench does not report, from its request records."""
    per_request = [
        (r["e2e"] - r["ttft"]) / (r["completion_tokens"] - 1)
        for r in target.get("results", [])
        if r.get("status") == 200
        and r.get("ttft") is not None
        and r.get("e2e") is not None
        and r.get("completion_tokens", 0) > 1
    ]
    return {
        "requests": target.get("ok"),
        "errors": target.get("errors"),
        "hit_rate": target.get("hit_rate"),
        "hit_rate_client": target.get("hit_rate_client"),
        "time_to_first_token": target.get("ttft_s") or {},
        "inter_token_latency": latency_stats(per_request),
        "inter_chunk_latency": target.get("itl_s") or {},
        "request_latency": target.get("e2e_s") or {},
        "request_throughput": target.get("request_throughput"),
        "output_token_throughput": target.get("output_token_throughput"),
    }


def agreement_rows(
    aiperf: Mapping[str, Mapping[str, Any]], bench: Mapping[str, Mapping[str, Any]]
) -> list[list[str]]:
    """Per target, AIPerf's number, ``kvroute bench``'s and their ratio."""
    names = [n for n in aiperf if n in bench]
    header = ["metric"]
    for n in names:
        header += [f"{n} AIPerf", f"{n} bench", "AIPerf/bench"]
    rows = [header]
    for label, key, stat, show in ROWS:
        row = [label]
        for n in names:
            a, b = _value(aiperf[n], key, stat), _value(bench[n], key, stat)
            row += [show(a), show(b), _ratio(a, b)]
        rows.append(row)
    return rows


# ------------------------------------------------------------------------- running it


def aiperf_argv(
    executable: Path, url: str, trace_file: Path, block: int, artifacts: Path
) -> list[str]:
    """The ``aiperf profile`` command line of one run."""
    return [
        str(executable),
        "profile",
        "--model",
        MODEL,
        "--tokenizer",
        MODEL,
        "--url",
        url,
        "--endpoint-type",
        "completions",
        "--streaming",
        "--input-file",
        str(trace_file),
        "--custom-dataset-type",
        "mooncake_trace",
        "--fixed-schedule",
        "--isl-block-size",
        str(block),
        "--use-server-token-count",
        "--random-seed",
        "0",
        "--artifact-dir",
        str(artifacts),
        "--ui-type",
        "none",
        # Two cores: AIPerf's workers share them with the engines and the router.
        "--workers-max",
        "2",
    ]


def run_aiperf(
    executable: Path,
    name: str,
    spec: str,
    trace_file: Path,
    block: int,
    hf_home: Path,
    outdir: Path,
    timeout: float,
) -> dict[str, Any]:
    """One target on fresh engines, driven by AIPerf: AIPerf's numbers and the engines'
    hit rate."""
    target = parse_target(f"{name}={spec}")
    options = StackOptions(engines=ENGINES, engine_args=ENGINE_ARGS)
    artifacts = outdir / name
    env = {
        **os.environ,
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    with Stack(target, options) as stack:
        argv = aiperf_argv(executable, stack.url, trace_file, block, artifacts)
        print(f"bench-aiperf: HF_HOME={hf_home} HF_HUB_OFFLINE=1 {shlex.join(argv)}", flush=True)
        before = _snapshot(stack.engine_urls)
        started = time.monotonic()
        proc = subprocess.run(
            argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
        )
        wall = time.monotonic() - started
        after = _snapshot(stack.engine_urls)
    (outdir / f"{name}.log").write_text(proc.stdout + proc.stderr)
    export = artifacts / "profile_export_aiperf.json"
    if proc.returncode != 0 or not export.exists():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"aiperf exited with status {proc.returncode} for {name}:\n{tail}")
    result = parse_export(json.loads(export.read_text()))
    result["hit_rate"] = hit_rate(before, after)
    result["wall_time_s"] = wall
    result["command"] = shlex.join(argv)
    return result


def run_bench(replay: Replay, outdir: Path) -> dict[str, dict[str, Any]]:
    """``kvroute bench`` on the same requests and targets; its summaries by target."""
    from router.cli import main as kvroute

    argv = [
        "bench",
        "--engines",
        str(ENGINES),
        "--model",
        MODEL,
        "--engine-args",
        shlex.join(ENGINE_ARGS),
        "--compare",
        *TARGETS,
        "--baseline",
        "rr",
        *replay.bench_args(),
        "--no-plots",
        "--quiet",
        "--output",
        str(outdir),
    ]
    print(f"bench-aiperf: .venv/bin/kvroute {shlex.join(argv)}", flush=True)
    if kvroute(argv) != 0:
        raise RuntimeError("kvroute bench answered nothing")
    document = json.loads((outdir / "results.json").read_text())
    return {t["name"]: bench_summary(t) for t in document["targets"]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m router.bench.aiperf", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--build-dir", type=Path, default=BUILD)
    parser.add_argument("--output", type=Path, default=Path("bench-results/aiperf"))
    parser.add_argument("--requests", type=int, default=Replay.requests)
    parser.add_argument("--speedup", type=float, default=Replay.speedup)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per AIPerf run")
    args = parser.parse_args(argv)

    executable, why = install(args.build_dir)
    if executable is None:
        print(f"bench-aiperf: skipped, AIPerf is not available ({why})")
        return 0
    replay = Replay(requests=args.requests, speedup=args.speedup)
    venv = args.build_dir / "venv"
    corpus = aiperf_corpus(venv)
    if corpus is None:
        print(f"bench-aiperf: no prompt corpus found in {venv} (is this {AIPERF_SPEC}?)")
        return 1
    words = corpus_words(corpus.read_text(encoding="utf-8"))
    hf_home = (args.build_dir / "hf-home").resolve()
    snapshot = hf_cache_entry(hf_home, MODEL, word_tokenizer_files(words))
    print(f"bench-aiperf: tokenizer {MODEL} ({len(words):,} words) at {snapshot}")

    trace = read_trace(replay.trace)
    chosen = select(trace.requests, limit=replay.requests, speedup=replay.speedup)
    expander = PromptExpander(trace.block_tokens, replay.scale)
    args.output.mkdir(parents=True, exist_ok=True)
    trace_file = (args.output / "mooncake.jsonl").resolve()
    trace_file.write_text("\n".join(trace_lines(chosen, expander, replay.max_output_tokens)) + "\n")
    description = (
        f"{trace.name}: first {len(chosen)} of {len(trace.requests)} requests on the trace's "
        f"timestamps / {replay.speedup:g} ({chosen[-1].at:.0f} s of arrivals); prompt lengths "
        f"x{replay.scale:g} ({expander.block_len}-token blocks); outputs capped at "
        f"{replay.max_output_tokens}; blocks reusable with an infinite cache: "
        f"{oracle_hit_rate(chosen):.1%}; {ENGINES} fresh emulated engines per target"
    )
    print(f"bench-aiperf: {description}\n", flush=True)

    started = time.time()
    aiperf: dict[str, dict[str, Any]] = {}
    for text in TARGETS:
        name, spec = text.split("=", 1)
        aiperf[name] = run_aiperf(
            executable,
            name,
            spec,
            trace_file,
            expander.block_len,
            hf_home,
            args.output,
            args.timeout,
        )
    bench = run_bench(replay, args.output / "kvroute-bench")

    first = aiperf_rows(aiperf, "rr")
    second = agreement_rows(aiperf, bench)
    print(f"\nAIPerf {AIPERF_SPEC.split('==')[1]} through kvroute ({description})\n")
    print(render_text(first))
    print("\nAIPerf vs kvroute bench on the same requests\n")
    print(render_text(second))
    (args.output / "summary.md").write_text(
        f"{description}\n\nAIPerf through kvroute:\n\n{render_markdown(first)}\n\n"
        f"AIPerf vs kvroute bench:\n\n{render_markdown(second)}\n"
    )
    document = {
        "aiperf": AIPERF_SPEC,
        "workload": description,
        "replay": {
            "trace": replay.trace,
            "requests": len(chosen),
            "speedup": replay.speedup,
            "scale": replay.scale,
            "block_tokens": expander.block_len,
            "max_output_tokens": replay.max_output_tokens,
        },
        "wall_time_s": time.time() - started,
        "aiperf_runs": aiperf,
        "kvroute_bench": bench,
    }
    (args.output / "results.json").write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nwrote {args.output / 'results.json'}, {args.output / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
