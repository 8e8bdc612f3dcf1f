"""Multi-tenant workloads for ``kvroute bench --tenants``: open-loop arrivals per tenant,
each with its own rate, priority, API key and request shape; results per tenant.

A tenant is ``NAME:rate=R[,priority=P][,key=KEY][,prompt=TOKENS][,output=TOKENS]``:
``R`` requests per second arriving as a Poisson process (seeded), every request sent
with ``x-kvroute-tenant: NAME``, ``x-kvroute-priority: P`` when given and
``Authorization: Bearer KEY`` when given. Results per tenant: requests sent, answered,
refused (429), failed otherwise, TTFT p50 / p99 of the answered ones, and throughput.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from router.bench.loadgen import Result, run_load
from router.workloads.generated import words
from router.workloads.spec import RequestSpec
from router.workloads.stats import percentile

DEFAULT_PROMPT_TOKENS = 200
DEFAULT_OUTPUT_TOKENS = 32


@dataclass(slots=True, frozen=True)
class TenantSpec:
    """One tenant of a multi-tenant workload."""

    name: str
    rate: float
    """Requests per second (Poisson arrivals)."""
    priority: int | None = None
    key: str | None = None
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    output_tokens: int = DEFAULT_OUTPUT_TOKENS

    def headers(self) -> dict[str, str]:
        out = {"x-kvroute-tenant": self.name}
        if self.priority is not None:
            out["x-kvroute-priority"] = str(self.priority)
        if self.key:
            out["Authorization"] = f"Bearer {self.key}"
        return out


def parse_tenant(text: str) -> TenantSpec:
    """``NAME:rate=R,priority=P,key=K,prompt=N,output=N`` (raises ValueError naming the
    bad part)."""
    name, sep, rest = text.partition(":")
    if not name or not sep:
        raise ValueError(f"--tenants {text!r}: expected NAME:rate=R[,priority=P,key=K,...]")
    fields: dict[str, str] = {}
    for part in rest.split(","):
        key, eq, value = part.partition("=")
        if not eq or key not in ("rate", "priority", "key", "prompt", "output"):
            raise ValueError(f"--tenants {text!r}: unknown or empty setting {part!r}")
        fields[key] = value
    if "rate" not in fields:
        raise ValueError(f"--tenants {text!r}: rate=R (requests per second) is required")
    try:
        rate = float(fields["rate"])
        priority = int(fields["priority"]) if "priority" in fields else None
        prompt = int(fields.get("prompt", DEFAULT_PROMPT_TOKENS))
        output = int(fields.get("output", DEFAULT_OUTPUT_TOKENS))
    except ValueError as exc:
        raise ValueError(f"--tenants {text!r}: {exc}") from None
    if rate <= 0 or prompt <= 0 or output <= 0:
        raise ValueError(f"--tenants {text!r}: rate, prompt and output must be positive")
    return TenantSpec(name, rate, priority, fields.get("key") or None, prompt, output)


def tenant_specs(tenant: TenantSpec, duration: float, seed: int = 0) -> list[RequestSpec]:
    """The tenant's requests over ``duration`` seconds: Poisson arrival times, distinct
    prompts (no shared prefix, so caching helps no tenant)."""
    rng = random.Random(f"{seed}:{tenant.name}")
    specs: list[RequestSpec] = []
    at = rng.expovariate(tenant.rate)
    while at < duration:
        prompt = words(rng, tenant.prompt_tokens, tag=tenant.name[:1] or "t")
        specs.append(
            RequestSpec(prompt=prompt, max_tokens=tenant.output_tokens, group=tenant.name, at=at)
        )
        at += rng.expovariate(tenant.rate)
    return specs


async def run_tenants(
    base_url: str,
    tenants: Sequence[TenantSpec],
    duration: float,
    *,
    model: str | None = None,
    timeout: float = 120.0,
    seed: int = 0,
) -> dict[str, list[Result]]:
    """Every tenant's requests at once, each tenant with its own headers."""
    runs = [
        run_load(
            base_url,
            tenant_specs(t, duration, seed),
            concurrency=100_000,  # open loop: arrivals are never held back by the client
            model=model,
            timeout=timeout,
            headers=t.headers(),
        )
        for t in tenants
    ]
    results = await asyncio.gather(*runs)
    return {t.name: r for t, r in zip(tenants, results, strict=True)}


def summarize_tenant(
    tenant: TenantSpec, results: Sequence[Result], duration: float
) -> dict[str, Any]:
    """One tenant's row: counts, TTFT percentiles (s) of answered requests, throughput."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    return {
        "tenant": tenant.name,
        "rate": tenant.rate,
        "priority": tenant.priority,
        "sent": len(results),
        "ok": len(ok),
        "refused": sum(1 for r in results if r.status == 429),
        "failed": sum(1 for r in results if not r.ok and r.status != 429),
        "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
        "throughput_rps": len(ok) / duration,
        "output_tok_s": sum(r.completion_tokens for r in ok) / duration,
    }


def render_rows(rows: Sequence[dict[str, Any]]) -> str:
    """A text table of tenant rows."""
    head = [
        "tenant",
        "rate/s",
        "prio",
        "sent",
        "ok",
        "429",
        "failed",
        "TTFT p50",
        "TTFT p99",
        "ok/s",
    ]
    lines = [head]
    for r in rows:
        lines.append(
            [
                str(r["tenant"]),
                f"{r['rate']:g}",
                "" if r["priority"] is None else str(r["priority"]),
                str(r["sent"]),
                str(r["ok"]),
                str(r["refused"]),
                str(r["failed"]),
                _ms(r["ttft_p50_s"]),
                _ms(r["ttft_p99_s"]),
                f"{r['throughput_rps']:.1f}",
            ]
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in lines
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"
