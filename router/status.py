"""``kvroute status URL``: a running router's engines, their state, load and index share,
and the tokenizer each model's pool uses.

Reads ``GET URL/admin/engines`` and prints a table (one row per engine, and one per
data-parallel rank when an engine has several), then one line per model pool saying
which tokenizer it is on and why (``hf: /models/llama/tokenizer.json (engine root)``);
or the JSON itself with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "url",
        metavar="URL",
        help="the router's HTTP address, e.g. http://127.0.0.1:8000 (or host:port)",
    )
    parser.add_argument("--json", action="store_true", help="print the JSON answer as it is")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait (default 5)")


def router_url(address: str) -> str:
    """``host:port`` -> ``http://host:port``; a URL stays as it is."""
    return address if "://" in address else f"http://{address}"


def fetch(url: str, timeout: float) -> dict[str, Any]:
    """The router's ``/admin/engines`` answer; raises RuntimeError with a clear reason."""
    url = router_url(url)
    request = urllib.request.Request(url.rstrip("/") + "/admin/engines")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:  # every kvroute router serves /admin/engines
            raise RuntimeError(
                f"{url} is not a kvroute router (no /admin/engines there; an engine?)"
            ) from None
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise RuntimeError(f"{url} answered {exc.code}: {message}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise RuntimeError(f"cannot reach {url}: {reason}") from None
    except ValueError:
        raise RuntimeError(f"{url} did not answer JSON; is it a kvroute router?") from None
    if not isinstance(answer, dict) or not isinstance(answer.get("engines"), list):
        raise RuntimeError(f"{url} is not a kvroute router (its /admin/engines is no list)")
    return answer


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def _latency(rank: dict[str, Any] | None) -> tuple[str, str, str]:
    """A rank's fitted latency lines: prefill µs per token, TTFT overhead ms, lone TPOT ms
    (``-`` from a router that keeps none)."""
    fit = (rank or {}).get("latency")
    if not fit:
        return ("-", "-", "-")
    return (
        f"{fit['prefill_us_per_token']:.1f}",
        f"{fit['ttft_overhead_ms']:.1f}",
        f"{fit['tpot_base_ms']:.1f}",
    )


def table(engines: list[dict[str, Any]]) -> str:
    """The engines as an aligned text table (the latency columns are the fitted lines of
    the online latency model: router/fleet/latency.py)."""
    head = (
        "ENGINE",
        "ROLE",
        "STATE",
        "MODELS",
        "INFLIGHT",
        "PREFILL_Q",
        "INDEX_BLOCKS",
        "SHARE",
        "US/TOKEN",
        "TTFT0_MS",
        "TPOT_MS",
    )
    rows: list[tuple[str, ...]] = [head]
    for e in engines:
        ranks = e.get("ranks") or []
        rows.append(
            (
                e["endpoint"],
                e["role"],
                e["state"],
                ",".join(e["models"]) or "-",
                str(e["inflight_requests"]),
                str(sum(r["queued_prefill_tokens"] for r in ranks)),
                _count(e["index_blocks"]),
                _share(e["index_share"]),
                *_latency(ranks[0] if len(ranks) == 1 else None),
            )
        )
        if len(ranks) > 1:
            for r in ranks:
                rows.append(
                    (
                        f"  dp{r['rank']}",
                        "",
                        "",
                        "",
                        str(r["inflight_requests"]),
                        str(r["queued_prefill_tokens"]),
                        _count(r["index_blocks"]),
                        _share(r["index_share"]),
                        *_latency(r),
                    )
                )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    if not engines:
        lines.append("(no engines)")
    return "\n".join(lines)


def tokenizer_table(tokenizers: list[dict[str, Any]]) -> str:
    """Each model pool's tokenizer: its mode, the path it is on and why (approximate
    pools with their characters per pseudo-token)."""
    rows = [("MODEL", "TOKENIZER")]
    for t in tokenizers:
        line = t["description"]
        if t.get("chars_per_token") is not None:
            measured = ", measured" if t.get("calibrated") else ""
            line += f" [{t['chars_per_token']} characters per token{measured}]"
        rows.append((t["model"], line))
    width = max(len(model) for model, _ in rows)
    return "\n".join(f"{model.ljust(width)}  {line}" for model, line in rows)


def run(args: argparse.Namespace) -> int:
    try:
        answer = fetch(args.url, args.timeout)
    except RuntimeError as exc:
        print(f"kvroute status: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        print(table(answer["engines"]))
        tokenizers = answer.get("tokenizers")  # routers before this field have none
        if isinstance(tokenizers, list) and tokenizers:
            print()
            print(tokenizer_table(tokenizers))
    return 0
