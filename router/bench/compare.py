"""``make bench-compare``: kvroute against round robin and the routers users know.

Every target gets 4 fresh emulated engines (prefill cost doubled so the shortened
prompts still load them; KV events on TCP so every router can read them) and the same
two workloads: a reduced Mooncake conversation replay and a multi-turn chat with a
shared system prompt. Targets:

* ``kvroute``: ``kvroute serve`` with its default policy (``kv_cost``);
* ``rr``: ``kvroute serve --policy round_robin`` (the baseline of every ratio);
* ``sglang_ca``: kvroute's re-implementation of sglang-router's ``cache_aware``;
* ``sglang``, ``vllm_ca``, ``vllm_kv``: the real sglang-router (cache_aware) and
  vllm-router (cache_aware, and kv_aware fed with the engines' KV events), installed
  from PyPI into ``build/compat`` (``make compat`` does the same); skipped, with the
  reason, when they cannot be installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from router.emulator.compat import install

BUILD = Path("build/compat")
ENGINE_ARGS = "--prefill-us-per-token 100 --kv-events-endpoint tcp://127.0.0.1:*"
COMMON = "--host {host} --port {port} --prometheus-host 127.0.0.1 --prometheus-port {free_port}"


def targets() -> list[str]:
    found = [
        "kvroute=policy:kv_cost",
        "rr=policy:round_robin",
        "sglang_ca=policy:cache_aware_sglang",
    ]
    sglang, why = install(BUILD, "sglang-router")
    if sglang is not None:
        found.append(
            f"sglang=cmd:{sglang} launch {COMMON} --policy cache_aware --worker-urls {{engines}}"
        )
    else:
        print(f"bench-compare: no sglang-router ({why})", file=sys.stderr)
    vllm, why = install(BUILD, "vllm-router")
    if vllm is not None:
        found.append(f"vllm_ca=cmd:{vllm} {COMMON} --policy cache_aware --worker-urls {{engines}}")
        found.append(
            f"vllm_kv=cmd:{vllm} {COMMON} --policy kv_aware --worker-urls {{engines}} "
            "{each:--kv-event-source:kv_event_sources} "
            "{each:--kv-event-replay-source:kv_event_replay_sources} "
            "--kv-event-block-size 16 --kv-event-model kvroute-emulated"
        )
    else:
        print(f"bench-compare: no vllm-router ({why})", file=sys.stderr)
    return found


def main() -> int:
    BUILD.mkdir(parents=True, exist_ok=True)
    base = [
        "--engines",
        "4",
        "--model",
        "kvroute-emulated",
        "--engine-args",
        ENGINE_ARGS,
        "--baseline",
        "rr",
        "--compare",
        *targets(),
    ]
    runs = [
        [
            "--workload",
            "mooncake-conversation",
            "--requests",
            "1500",
            "--speedup",
            "8",
            "--scale",
            "0.0625",
            "--max-output-tokens",
            "128",
            "--output",
            "bench-results/compare-mooncake",
        ],
        [
            "--workload",
            "chat",
            "--conversations",
            "64",
            "--turns",
            "6",
            "--system-tokens",
            "1000",
            "--question-tokens",
            "200",
            "--output-tokens",
            "100",
            "--concurrency",
            "16",
            "--output",
            "bench-results/compare-chat",
        ],
    ]
    status = 0
    for run in runs:
        status |= _bench([*base, *run])
    return status


def _bench(argv: list[str]) -> int:
    from router.cli import main as kvroute

    return kvroute(["bench", *argv])


if __name__ == "__main__":
    sys.exit(main())
