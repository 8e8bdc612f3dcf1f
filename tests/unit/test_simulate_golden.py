"""``kvroute simulate`` reproduces its outputs byte for byte on three workloads: the
``kvroute bench --help`` chat example (every policy), shared-prefix groups (4 colocated
engines, and a 1P+3D disaggregated fleet with 32 requests in flight, enough that the
decode choice sees the load each split's legs charge) and the first 200 requests of the
bundled Mooncake conversation trace (one and two router replicas). Issue 45 moves the
code under the simulator; these files say it still decides and prices every request as
before.

Each ``tests/fixtures/golden/simulate_<name>.txt`` holds the command (the flags as
given, ``--quiet --output <output>`` added), what it printed to stdout, then, after a
``=== results.json ===`` line, its ``results.json``. The CLI runs in this process
(``router.cli.main``) on the virtual clock, so every number is deterministic except
these, left out:

- the table's ``wall time`` row (lines matching ``WALL_ROW``) and each run's ``wall_s``:
  the host's wall clock (``--quiet`` drops the line per run, which prints it too). A
  wall time under 10 s (these runs take well under 1 s each) is never wider than its
  column's name, so it never moves the table's other cells;
- ``results.json``'s ``router_index.bytes`` and ``bytes_per_entry``: sizes of the index's
  Python objects, which follow the interpreter, not the simulation (``entries`` and
  ``expiring`` stay);
- ``results.json``'s ``kvroute_version`` (the release) and ``command`` (this process's
  ``sys.argv``);
- the output directory, a temporary one, shown as ``<output>``.

When a change of simulated behaviour is meant, rewrite the files and commit them with it::

    REGEN_GOLDEN=1 .venv/bin/python -m pytest -q tests/unit/test_simulate_golden.py
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from support.golden import check_golden

from router.cli import main

#: The workloads, by the name of their golden file.
WORKLOADS: dict[str, str] = {
    "help-chat": "--workload chat --conversations 24 --turns 4 --engines 4 --policy all",
    "groups": (
        "--workload shared-prefix --groups 16 --prompts-per-group 8 --prefix-tokens 2000 "
        "--output-spread 0.5 --concurrency 32 --fleet 4 --fleet 1P+3D "
        "--policy default --policy round_robin --policy kv_cost"
    ),
    "mooncake": (
        "--trace mooncake-conversation --requests 200 --speedup 8 --scale 0.0625 "
        "--max-output-tokens 128 --engines 4 --prefill-us-per-token 100 "
        "--policy default --policy round_robin --policy kv_cost --replicas 1,2 --sync-delay-ms 5"
    ),
}

#: The table's wall-time row (one per wrapped part of the table).
WALL_ROW = re.compile(r"^wall time +.*\n", flags=re.M)


def results(document: dict[str, Any]) -> str:
    """``results.json`` without the fields that are not the simulation's."""
    document = {k: v for k, v in document.items() if k not in ("kvroute_version", "command")}
    for run in document["runs"]:
        del run["wall_s"]
        for key in ("bytes", "bytes_per_entry"):
            del run["router_index"][key]
    return json.dumps(document, indent=1) + "\n"


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_simulate_reproduces_its_outputs(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = f"{WORKLOADS[name]} --quiet --output"
    assert main(["simulate", *shlex.split(flags), str(tmp_path)]) == 0
    printed = WALL_ROW.sub("", capsys.readouterr().out).replace(str(tmp_path), "<output>")
    document = json.loads((tmp_path / "results.json").read_text())
    text = f"$ kvroute simulate {flags} <output>\n{printed}\n=== results.json ===\n"
    check_golden(f"simulate_{name}.txt", text + results(document))
