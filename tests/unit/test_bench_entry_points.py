"""Every ``python -m router.bench.*`` entry point (a contract: the Makefile, the docs and
users' scripts run them) answers ``--help`` with its usage and runs nothing else.

In process: each module's ``main`` is called with ``--help`` (argparse exits 0 after
printing the usage). ``scale_dynamo`` is left out: ``router/bench/scale.py`` runs it by
its path in Dynamo's own virtualenv, with positional numbers only."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "router" / "bench"
NOT_A_COMMAND = {"scale_dynamo"}


def _entry_points() -> list[str]:
    found = []
    for path in sorted(BENCH.rglob("*.py")):
        tree = ast.parse(path.read_text())
        guarded = any(
            isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body
        )
        if guarded or path.name == "__main__.py":
            module = ".".join(path.relative_to(BENCH.parents[1]).with_suffix("").parts)
            found.append(module.removesuffix(".__main__"))
    return [m for m in found if m.rsplit(".", 1)[-1] not in NOT_A_COMMAND]


ENTRY_POINTS = _entry_points()


def test_the_entry_points_are_found() -> None:
    assert {"router.bench.core", "router.bench.peers", "router.bench.compare"} <= set(ENTRY_POINTS)
    assert "router.bench.soak" in ENTRY_POINTS


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_prints_the_usage_and_runs_nothing(
    module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    main = importlib.import_module(module if not module.endswith("soak") else module + ".run").main
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")
