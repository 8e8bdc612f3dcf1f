"""Every ``python -m router...`` entry point (a contract: the Makefile, the docs and
users' scripts run them; ``python -m router.bench.*`` above all) answers ``--help`` with
its usage and runs nothing else.

In process: each module's ``main`` (a package's ``__main__`` names the ``main`` it runs)
is called with ``--help``, and argparse exits 0 after printing the usage. Left out:
``router/bench/scale_dynamo.py``, which ``router/bench/scale.py`` runs by its path in
Dynamo's own virtualenv with positional numbers only, and ``router/config.py``, whose
``--update FILE`` is ``make docs``'s generator of the configuration reference."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
NOT_A_COMMAND = {"router.bench.scale_dynamo", "router.config"}


def _runs(path: Path, tree: ast.Module) -> str:
    """The module whose ``main`` ``path`` runs: itself, or for a package's
    ``__main__.py`` the module it imports ``main`` from."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    if path.name != "__main__.py":
        return module
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(a.name == "main" for a in node.names):
            assert node.module is not None
            return node.module
    raise AssertionError(f"{path} imports no main")


def _entry_points() -> dict[str, str]:
    """Each ``python -m`` name, with the module whose ``main`` it runs."""
    found = {}
    for path in sorted((ROOT / "router").rglob("*.py")):
        tree = ast.parse(path.read_text())
        guarded = any(
            isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body
        )
        if guarded or path.name == "__main__.py":
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__main__")] = _runs(path, tree)
    return {name: runs for name, runs in found.items() if name not in NOT_A_COMMAND}


ENTRY_POINTS = _entry_points()


def test_the_entry_points_are_found() -> None:
    assert {"router.bench.core", "router.bench.peers", "router.bench.compare"} <= set(ENTRY_POINTS)
    assert ENTRY_POINTS["router.bench.soak"] == "router.bench.soak.run"
    assert ENTRY_POINTS["router"] == "router.cli"
    assert {"router.demo", "router.emulator.bench"} <= set(ENTRY_POINTS)


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_help_prints_the_usage_and_runs_nothing(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    main = importlib.import_module(ENTRY_POINTS[name]).main
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")
