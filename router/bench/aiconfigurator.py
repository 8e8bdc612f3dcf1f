"""``make bench-aiconfigurator``: ``kvroute plan`` beside NVIDIA AIConfigurator.

Both are asked the same question at several points: for a model on a GPU budget, at
one prompt length (ISL), output length (OSL) and TTFT / per-token (TPOT) targets, is
aggregated (colocated) or disaggregated serving better, and with which prefill:decode
split? AIConfigurator (from PyPI, in its own virtualenv under ``build/aiconfigurator``;
never a kvroute dependency) answers from its bundled per-GPU performance database,
offline. ``kvroute plan`` answers by simulating the colocated fleet and every split,
twice: with its default engine model (``h100-8b``, an 8B model on one H100) and
calibrated from AIConfigurator's database for the same model and GPU (one GPU per
engine, tensor parallelism 1): prefill cost per token, decode step time by batch and
context, KV bytes per token, KV-cache capacity, transfer bandwidth. The calibration is
printed as ``kvroute plan`` flags, so it can be reused as a preset.

When AIConfigurator cannot be installed the reason goes to
``build/aiconfigurator/UNAVAILABLE`` and the comparison is skipped with it.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router.bench.aiperf import install
from router.engine_model import EngineParams
from router.workloads.tables import render_markdown, render_text

AIC_SPEC = "aiconfigurator==0.12.0"
BUILD = Path("build/aiconfigurator")
MODEL = "Qwen/Qwen3-32B"
SYSTEM = "h200_sxm"
BACKEND = "vllm"
GPUS = 8
#: KV-cache share of GPU memory after weights, as vLLM's gpu_memory_utilization 0.9.
MEMORY_UTILIZATION = 0.9
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Point:
    """One question asked of both tools."""

    isl: int
    osl: int
    ttft_ms: float
    tpot_ms: float
    why: str


POINTS = [
    Point(512, 256, 500, 30, "short prompts: colocated should win"),
    Point(4_000, 500, 1_000, 50, "the issue's example"),
    Point(8_000, 200, 3_000, 20, "long prompts, tight TPOT"),
    Point(16_000, 500, 5_000, 30, "very long prompts"),
]

#: Run by AIConfigurator's Python: its estimates for one GPU (tensor parallelism 1) of
#: the model, as JSON, for :func:`calibrate`.
PROBE = """
import json, sys
from aiconfigurator_core.sdk.engine import EngineHandle
from aiconfigurator_core.sdk.utils import get_model_config_from_model_path
import aiconfigurator_core, yaml, pathlib
model, system, backend = sys.argv[1:4]
h = EngineHandle.compile(model, system, backend, tp_size=1)
prefill = [[n, h.predict_prefill_latency(1, n)] for n in (256, 512, 1024, 2048, 4096, 8192)]
decode = [[b, c, h.decode_step_latency(b, c, 2)]
          for b in (1, 8, 32, 64, 128, 256) for c in (1000, 4000, 8000)]
spec = pathlib.Path(aiconfigurator_core.__file__).parent / "systems" / f"{system}.yaml"
print(json.dumps({"prefill": prefill, "decode": decode,
                  "model": get_model_config_from_model_path(model),
                  "system": yaml.safe_load(spec.read_text())}, default=str))
"""


# ------------------------------------------------------------------------ calibration


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a small dense system)."""
    n = len(vector)
    a = [[*row, vector[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col and a[col][col]:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]


def least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Coefficients minimising the squared error of ``rows · c = ys``."""
    k = len(rows[0])
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(k)]
    return _solve(ata, aty)


def dense_weight_bytes(model: Mapping[str, Any], dtype_bytes: int = 2) -> float:
    """Weights of a dense decoder (attention, gated MLP, embeddings in and out)."""
    h, layers, d = model["hidden_size"], model["layers"], model["d"]
    attn = h * model["n"] * d * 2 + h * model["n_kv"] * d * 2
    mlp = 3 * h * model["inter_size"]
    return float(dtype_bytes * (layers * (attn + mlp) + 2 * model["vocab"] * h))


def calibrate(probe: Mapping[str, Any]) -> dict[str, float]:
    """kvroute engine-model settings from AIConfigurator's one-GPU estimates.

    kvroute's step time is ``overhead + prefill tokens x prefill cost + decode
    sequences x per-sequence cost + context tokens read x per-token cost``. The decode
    terms are a least-squares fit of AIConfigurator's decode step latencies over batch
    size and context length; the prefill cost is the slope of its prefill latency over
    prompt length (a line through a curve with an attention term: long prompts cost a
    little more per token than the line says). KV bytes per token and the cache
    capacity follow from the model's shape and the GPU's memory; the transfer
    bandwidth is the system's intra-node (NVLink) bandwidth.
    """
    decode = probe["decode"]
    a, per_seq, per_ctx = least_squares(
        [[1.0, float(b), float(b * c)] for b, c, _ in decode], [ms for _, _, ms in decode]
    )
    prefill = probe["prefill"]
    _, per_token = least_squares([[1.0, float(n)] for n, _ in prefill], [ms for _, ms in prefill])
    model, system = probe["model"], probe["system"]
    kv_bytes = 2 * model["layers"] * model["n_kv"] * model["d"] * 2  # K and V in 16 bits
    memory = float(system["gpu"]["mem_capacity"]) * MEMORY_UTILIZATION
    free = memory - dense_weight_bytes(model) - float(system["misc"]["other_mem"])
    blocks = int(free // (kv_bytes * BLOCK_SIZE))
    return {
        "step_overhead_ms": round(a, 3),
        "prefill_us_per_token": round(per_token * 1e3, 2),
        "decode_us_per_seq": round(max(per_seq, 0.0) * 1e3, 2),
        "decode_ns_per_context_token": round(max(per_ctx, 0.0) * 1e6, 2),
        "kv_bytes_per_token": kv_bytes,
        "kv_transfer_bandwidth": float(system["node"]["intra_node_bw"]),
        "cache_blocks": blocks,
    }


def calibration_flags(settings: Mapping[str, float]) -> list[str]:
    """``kvroute plan`` / ``simulate`` / ``engine`` flags for calibrated settings."""
    out = []
    for key, value in settings.items():
        text = f"{value:g}" if isinstance(value, float) else str(value)
        out += [f"--{key.replace('_', '-')}", text]
    return out


# ------------------------------------------------------------------- AIConfigurator


def _first_row(path: Path) -> dict[str, str] | None:
    if not path.exists():
        return None
    with path.open(newline="") as f:
        return next(csv.DictReader(f), None)


def _int(text: str | None) -> int:
    return int(float(text)) if text else 0


def read_verdict(save_dir: Path) -> dict[str, Any]:
    """AIConfigurator's best aggregated and disaggregated configurations from the
    ``best_config_topn.csv`` files under ``save_dir``, and which wins (by tokens/s/GPU;
    a kind with no configuration within the SLOs counts as 0)."""
    agg_files = sorted(save_dir.glob("**/agg/best_config_topn.csv"))
    disagg_files = sorted(save_dir.glob("**/disagg/best_config_topn.csv"))
    agg = _first_row(agg_files[0]) if agg_files else None
    disagg = _first_row(disagg_files[0]) if disagg_files else None
    out: dict[str, Any] = {"agg": None, "disagg": None}
    if agg is not None:
        tp = _int(agg.get("tp")) * max(_int(agg.get("pp")), 1)
        out["agg"] = {
            "tokens_per_gpu": float(agg["tokens/s/gpu"]),
            "shape": f"{GPUS // max(tp, 1)} x tp{tp}",
            "ttft_ms": float(agg["ttft"]),
            "tpot_ms": float(agg["tpot"]),
        }
    if disagg is not None:
        p_tp, d_tp = _int(disagg.get("(p)tp")), _int(disagg.get("(d)tp"))
        p_workers, d_workers = _int(disagg.get("(p)workers")), _int(disagg.get("(d)workers"))
        replica = p_workers * p_tp + d_workers * d_tp
        replicas = GPUS // replica if replica else 0
        out["disagg"] = {
            "tokens_per_gpu": float(disagg["tokens/s/gpu"]),
            "prefill_gpus": replicas * p_workers * p_tp,
            "decode_gpus": replicas * d_workers * d_tp,
            "shape": (
                f"{replicas} x ({p_workers} x tp{p_tp} P + {d_workers} x tp{d_tp} D)"
                if replicas
                else "-"
            ),
            "ttft_ms": float(disagg["ttft"]),
            "tpot_ms": float(disagg["tpot"]),
        }
    a = out["agg"]["tokens_per_gpu"] if out["agg"] else 0.0
    d = out["disagg"]["tokens_per_gpu"] if out["disagg"] else 0.0
    out["winner"] = None if a == d == 0 else ("aggregated" if a >= d else "disaggregated")
    out["agg_over_disagg"] = a / d if d else None
    return out


def run_aiconfigurator(executable: Path, point: Point, workdir: Path) -> dict[str, Any]:
    """``aiconfigurator cli default`` at ``point``: its verdict and its command."""
    save = workdir / f"aic-{point.isl}-{point.osl}"
    argv = [
        str(executable),
        "cli",
        "default",
        "--model-path",
        MODEL,
        "--total-gpus",
        str(GPUS),
        "--system",
        SYSTEM,
        "--backend",
        BACKEND,
        "--isl",
        str(point.isl),
        "--osl",
        str(point.osl),
        "--ttft",
        f"{point.ttft_ms:g}",
        "--tpot",
        f"{point.tpot_ms:g}",
        "--save-dir",
        str(save),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-10:])
        raise RuntimeError(f"aiconfigurator failed at {point}:\n{tail}")
    verdict = read_verdict(save)
    verdict["command"] = "HF_HUB_OFFLINE=1 aiconfigurator " + shlex.join(argv[1:-2])
    return verdict


def probe(python: Path) -> dict[str, Any]:
    """AIConfigurator's one-GPU estimates of the model (see :data:`PROBE`)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [str(python), "-c", PROBE, MODEL, SYSTEM, BACKEND],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"AIConfigurator probe failed:\n{proc.stderr[-2000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


# ------------------------------------------------------------------------ kvroute plan


def start_rate(point: Point, step_overhead_s: float, prefill_token_s: float) -> float:
    """Half the fleet's prefill capacity in requests/s: where the search starts, so it
    brackets the goodput in few steps."""
    return round(0.5 * GPUS / (step_overhead_s + point.isl * prefill_token_s), 3)


def plan_argv(point: Point, requests: int, rate: float, engine_flags: Sequence[str]) -> list[str]:
    """``kvroute plan`` at ``point``: unique prompts of ISL tokens with OSL-token outputs
    (a shared-prefix workload of one prompt per group), Poisson arrivals from ``rate``."""
    question = 16
    return [
        "--gpus",
        str(GPUS),
        "--rate",
        f"{rate:g}",
        "--ttft-slo-ms",
        f"{point.ttft_ms:g}",
        "--itl-slo-ms",
        f"{point.tpot_ms:g}",
        "--workload",
        "shared-prefix",
        "--groups",
        str(requests),
        "--prompts-per-group",
        "1",
        "--prefix-tokens",
        str(point.isl - question),
        "--question-tokens",
        str(question),
        "--output-tokens",
        str(point.osl),
        "--search-steps",
        "2",
        "--quiet",
        *engine_flags,
    ]


def run_plan(argv: Sequence[str]) -> dict[str, Any]:
    """``kvroute plan``'s search at ``argv``, in this process: every fleet's goodput,
    the colocated fleet's and the best split's."""
    from router.config import load_config
    from router.sim import capacity
    from router.sim.cli import model_params, settings_for
    from router.workloads.flags import build_workload

    parser = argparse.ArgumentParser()
    capacity.add_arguments(parser)
    args = parser.parse_args(list(argv))
    params = model_params(args)
    config = load_config(args.config)
    slo = capacity.Slo(args.ttft_slo_ms / 1e3, args.itl_slo_ms / 1e3, args.attainment)
    workload = build_workload(args, compact=True)
    specs = capacity.poisson_arrivals(workload.specs, args.rate, args.seed)
    points = capacity.plan_fleets(
        capacity.candidate_fleets(args.gpus),
        lambda factor: capacity.at_rate(specs, factor),
        capacity.base_rate(specs),
        lambda fleet: settings_for(fleet, args.policy, params, config, args, workload.concurrency),
        slo,
        args.search_steps,
    )
    colocated = points[0]
    best_split = max(points[1:], key=lambda p: p.rate)
    winner = "aggregated" if colocated.rate >= best_split.rate else "disaggregated"
    return {
        "colocated_rate": colocated.rate,
        "best_split": best_split.fleet.describe(),
        "best_split_rate": best_split.rate,
        "winner": winner if max(colocated.rate, best_split.rate) > 0 else None,
        "colocated_over_split": colocated.rate / best_split.rate if best_split.rate else None,
        "fleets": {p.fleet.describe(): p.rate for p in points},
    }


# ------------------------------------------------------------------------------ table


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _short(winner: str | None) -> str:
    return {"aggregated": "agg", "disaggregated": "disagg"}.get(winner or "", "none")


def table_rows(results: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """One row per point: AIConfigurator's verdict and split beside kvroute plan's with
    the default and the calibrated engine model."""
    rows = [
        [
            "ISL / OSL",
            "TTFT / TPOT",
            "AIC verdict (agg/disagg)",
            "AIC best agg",
            "AIC best disagg (GPUs P:D)",
            "plan h100-8b verdict (colo/split)",
            "plan h100-8b split",
            "plan calibrated verdict (colo/split)",
            "plan calibrated split",
        ]
    ]
    for r in results:
        p, aic = r["point"], r["aic"]
        agg, disagg = aic.get("agg"), aic.get("disagg")
        split = (
            f"{disagg['shape']} ({disagg['prefill_gpus']}:{disagg['decode_gpus']})"
            if disagg
            else "none within SLOs"
        )
        row = [
            f"{p['isl']:,} / {p['osl']:,}",
            f"{p['ttft_ms']:g} / {p['tpot_ms']:g} ms",
            f"{_short(aic['winner'])} ({_x(aic['agg_over_disagg'])})",
            agg["shape"] if agg else "none within SLOs",
            split,
        ]
        for key in ("plan_default", "plan_calibrated"):
            plan_result = r[key]
            row += [
                f"{_short(plan_result['winner'])} ({_x(plan_result['colocated_over_split'])})",
                plan_result["best_split"],
            ]
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m router.bench.aiconfigurator", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--build-dir", type=Path, default=BUILD)
    parser.add_argument("--output", type=Path, default=Path("bench-results/aiconfigurator"))
    parser.add_argument(
        "--requests", type=int, default=80, help="requests per simulated rate (kvroute plan)"
    )
    args = parser.parse_args(argv)

    executable, why = install(args.build_dir, AIC_SPEC, "aiconfigurator")
    if executable is None:
        print(f"bench-aiconfigurator: skipped, AIConfigurator is not available ({why})")
        return 0
    started = time.time()
    estimates = probe(executable.parent / "python")
    calibrated = calibrate(estimates)
    flags = calibration_flags(calibrated)
    print(f"bench-aiconfigurator: {MODEL} on one {SYSTEM} GPU ({BACKEND}), from AIConfigurator:")
    print(f"  kvroute plan {shlex.join(flags)}\n", flush=True)
    args.output.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="kvroute-aic-") as tmp:
        for point in POINTS:
            aic = run_aiconfigurator(executable, point, Path(tmp))
            base = EngineParams()
            default_argv = plan_argv(
                point,
                args.requests,
                start_rate(point, base.step_overhead_s, base.prefill_token_s),
                [],
            )
            calibrated_argv = plan_argv(
                point,
                args.requests,
                start_rate(
                    point,
                    calibrated["step_overhead_ms"] / 1e3,
                    calibrated["prefill_us_per_token"] / 1e6,
                ),
                flags,
            )
            result = {
                "point": {
                    "isl": point.isl,
                    "osl": point.osl,
                    "ttft_ms": point.ttft_ms,
                    "tpot_ms": point.tpot_ms,
                    "why": point.why,
                },
                "aic": aic,
                "plan_default": run_plan(default_argv),
                "plan_calibrated": run_plan(calibrated_argv),
                "plan_commands": [
                    "kvroute plan " + shlex.join(default_argv),
                    "kvroute plan " + shlex.join(calibrated_argv),
                ],
            }
            results.append(result)
            print(
                f"  ISL {point.isl} OSL {point.osl}: AIConfigurator {aic['winner']}, plan "
                f"{result['plan_default']['winner']} (h100-8b), "
                f"{result['plan_calibrated']['winner']} (calibrated)",
                flush=True,
            )
    rows = table_rows(results)
    print()
    print(render_text(rows))
    (args.output / "summary.md").write_text(render_markdown(rows) + "\n")
    document = {
        "aiconfigurator": AIC_SPEC,
        "model": MODEL,
        "system": SYSTEM,
        "backend": BACKEND,
        "gpus": GPUS,
        "calibration": calibrated,
        "calibration_flags": flags,
        "aic_estimates": {"prefill": estimates["prefill"], "decode": estimates["decode"]},
        "wall_time_s": time.time() - started,
        "points": results,
    }
    (args.output / "results.json").write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nwrote {args.output / 'results.json'}, {args.output / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
