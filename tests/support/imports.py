"""What the modules of ``router/`` import, read from their source with :mod:`ast`.

Every ``import`` and ``from ... import`` counts, at module level or inside a function
(a lazy import runs when its function does), except those under ``if TYPE_CHECKING:``,
which never run. ``from router.a import b`` where ``router/a/b.py`` exists imports that
module; importing ``router.a.b`` runs ``router/__init__.py`` and ``router/a/__init__.py``
first. Imports inside ``try`` blocks that catch ``ImportError`` are kept apart as
optional (the code runs without them), and so are packages imported only inside
functions (deferred: importing the module does not import them).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(slots=True)
class Imports:
    """One module's imports: kvroute modules, and top-level names of other packages."""

    modules: set[str] = field(default_factory=set)
    packages: set[str] = field(default_factory=set)
    optional_packages: set[str] = field(default_factory=set)
    deferred_packages: set[str] = field(default_factory=set)
    """Packages (of ``packages`` or ``optional_packages``) imported only in functions."""


def module_files(package: str = "router", root: Path = ROOT) -> dict[str, Path]:
    """Module name -> source file for every module of ``package``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _catches_import_error(node: ast.Try) -> bool:
    for handler in node.handlers:
        names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        for name in names:
            if isinstance(name, ast.Name) and name.id in ("ImportError", "ModuleNotFoundError"):
                return True
    return False


def _statements(
    body: Iterable[ast.stmt], optional: bool = False, deferred: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """(import statement, optional?, deferred?) for every import that can run."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, optional, deferred
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _statements(node.orelse, optional, deferred)
        elif isinstance(node, ast.Try):
            guarded = optional or _catches_import_error(node)
            yield from _statements(node.body, guarded, deferred)
            for part in (node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _statements(part, optional, deferred)
        else:
            inner = deferred or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    yield from _statements([child], optional, inner)
                elif isinstance(getattr(child, "body", None), list):  # match cases
                    yield from _statements(child.body, optional, inner)


def _with_parents(name: str, known: dict[str, Path]) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & known.keys()


def imports_of(module: str, known: dict[str, Path], package: str = "router") -> Imports:
    """What ``module`` (a key of ``known``) imports."""
    path = known[module]
    tree = ast.parse(path.read_text(), str(path))
    here = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = Imports()
    eager: set[str] = set()
    for node, optional, deferred in _statements(tree.body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            else:
                target = node.module or ""
            targets = [target]
            targets += [f"{target}.{alias.name}" for alias in node.names]
        for target in targets:
            top = target.split(".")[0]
            if top == package:
                out.modules |= _with_parents(target, known)
            elif top and top not in sys.stdlib_module_names and top != "__future__":
                (out.optional_packages if optional else out.packages).add(top)
                if not deferred:
                    eager.add(top)
    out.optional_packages -= out.packages
    out.deferred_packages = (out.packages | out.optional_packages) - eager
    return out


def reachable(roots: Iterable[str], known: dict[str, Path] | None = None) -> dict[str, Imports]:
    """Every kvroute module that importing ``roots`` can run, with its imports."""
    known = module_files() if known is None else known
    seen: dict[str, Imports] = {}
    todo = [m for root in roots for m in sorted(_with_parents(root, known))]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen[module] = imports_of(module, known)
        todo.extend(seen[module].modules - seen.keys())
    return seen


if __name__ == "__main__":  # print what `kvroute serve` imports
    graph = reachable(["router.cli", "router.serve"])
    packages: dict[str, set[str]] = {}
    for name, found in graph.items():
        for top in found.packages:
            packages.setdefault(top, set()).add(name)
        for top in found.optional_packages:
            packages.setdefault(f"{top} (optional)", set()).add(name)
    print(f"{len(graph)} modules")
    for top, users in sorted(packages.items()):
        print(f"{top}: {', '.join(sorted(users)[:4])}{' ...' if len(users) > 4 else ''}")
