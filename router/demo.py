"""``make demo``: two emulated engines, one repeated prompt, and the cache hits it gets.

Starts two ``kvroute engine`` processes on loopback (each in its own process group,
always stopped on the way out), sends the same ~2,000-token prompt to them in turn and
prints how many prompt tokens each engine served from its prefix cache.
Until the router exists this shows what it will exploit: a prompt is cheap only where
its prefix already is.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from typing import Any

from router.emulator.process import EngineProcess

PROMPT_TOKENS = 2_000
# (engine, what the row shows)
PLAN = [
    ("A", "first time anywhere"),
    ("A", "same engine again"),
    ("B", "another engine"),
    ("B", "that engine again"),
    ("A", "back to the first"),
]


def _complete(url: str, prompt: str) -> tuple[dict[str, Any], float]:
    body = json.dumps({"prompt": prompt, "max_tokens": 8}).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=30) as response:
        answer = json.load(response)
    return answer, time.perf_counter() - start


def main() -> int:
    prompt = " ".join(f"word{i}" for i in range(PROMPT_TOKENS))
    engines: dict[str, EngineProcess] = {}
    try:
        for name in ("A", "B"):
            engines[name] = EngineProcess(["--port", "0"])
            print(f"engine {name}: {engines[name].url}")
        print()
        print(f"{'#':>2}  {'engine':<6}  {'':<20}  {'prompt':>6}  {'cached':>6}  {'wall ms':>7}")
        for i, (name, note) in enumerate(PLAN, 1):
            answer, wall = _complete(engines[name].url, prompt)
            usage = answer["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            print(
                f"{i:>2}  {name:<6}  {note:<20}  {usage['prompt_tokens']:>6}  "
                f"{cached:>6}  {wall * 1000:>7.1f}"
            )
        print()
        print("cached = prompt tokens served from the engine's prefix cache (vLLM's rule:")
        print("whole 16-token blocks, never the last prompt token: 1,984 of 2,000).")
    finally:
        for engine in engines.values():
            engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
