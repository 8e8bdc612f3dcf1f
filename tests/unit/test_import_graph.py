"""No import cycle among the modules of ``router/`` at run time.

The graph is read from the source with :mod:`ast`: imports at module level and inside
functions count, those under ``if TYPE_CHECKING:`` do not (annotations only). Importing
``a.b.c`` runs the ``__init__`` of ``a.b`` first, so an import also points at the
packages above its target, except the importer's own packages (already being imported
when it runs). A cycle fails the test and is printed, module by module.

Beside it, rules on who may import whom, where every import counts (type-only ones
too): no module outside the front ends (``router/frontends/``) and the wiring that
builds them imports a front end, and the simulator does not import the benchmarks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import router

ROOT = Path(router.__file__).parent


def _modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module and package of ``router``."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = ["router", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, package: bool) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(imported module, names taken from it) for every run-time import in ``tree``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            for branch in node.orelse:  # ``else:`` of TYPE_CHECKING runs
                yield from _imports(ast.Module([branch], []), module, package)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: None if package else -1]
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            yield target, tuple(alias.name for alias in node.names)
        yield from _imports(node, module, package)


def import_graph() -> dict[str, set[str]]:
    """Module -> the ``router`` modules importing it runs."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = path.name == "__init__.py"
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        edges: set[str] = set()
        for target, names in _imports(ast.parse(path.read_text()), name, package):
            if not target.startswith("router"):
                continue
            parts = target.split(".")
            implicit = {".".join(parts[:i]) for i in range(2, len(parts))} - own
            explicit = {target} | {f"{target}.{n}" for n in names}
            edges |= {m for m in implicit | explicit if m in modules and m != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle (its modules in import order, the first repeated last), or None."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = []
        on_path: set[str] = set()
        stack: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        path.append(start)
        on_path.add(start)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif child in on_path:
                return [*path[path.index(child) :], child]
            elif child not in done:
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
                on_path.add(child)
    return None


def test_router_has_no_runtime_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_function_level_and_else_imports_count_and_type_only_ones_do_not() -> None:
    source = """
from typing import TYPE_CHECKING
from . import sibling
if TYPE_CHECKING:
    from router.app import RouterApp
else:
    import router.runtime_only
def later():
    from router.policy.base import Policy
"""
    found = dict(_imports(ast.parse(source), "router.frontends.http.routes", package=False))
    assert found == {
        "typing": ("TYPE_CHECKING",),
        "router.frontends.http": ("sibling",),
        "router.runtime_only": (),
        "router.policy.base": ("Policy",),
    }


def test_an_import_runs_the_packages_above_its_target() -> None:
    graph = import_graph()
    # ``from router.policy.base import ...`` runs router/policy/__init__.py first.
    assert {"router.policy", "router.policy.base"} <= graph["router.core"]
    assert "router.tracing" in graph["router.app"]  # imported inside RouterApp.__init__


#: Modules that take the pieces of a router they use, not the router (not even for types).
NARROW = (
    "router.admin",
    "router.frontends.extproc",
    "router.frontends.grpc.api",
    "router.frontends.grpc.server",
    "router.frontends.http.admin_routes",
    "router.frontends.http.observe",
    "router.frontends.http.routes",
    "router.handoff.base",
    "router.metrics",
    "router.plan",
    "router.reload",
    "router.serving.decide",
    "router.serving.services",
    "router.serving.split",
)


def test_the_front_ends_admin_reload_metrics_and_the_grpc_server_do_not_take_the_app() -> None:
    modules = _modules()
    for name in NARROW:
        found: set[str] = set()
        for node in ast.walk(ast.parse(modules[name].read_text())):
            if isinstance(node, ast.ImportFrom):
                found.add(node.module or "")
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        assert "router.app" not in found, name


def _reachable(graph: dict[str, set[str]], start: set[str]) -> set[str]:
    """Every module importing ``start`` runs, ``start`` included."""
    seen = set(start)
    todo = list(start)
    while todo:
        for child in graph[todo.pop()] - seen:
            seen.add(child)
            todo.append(child)
    return seen


def test_the_simulator_does_not_import_the_benchmark_package() -> None:
    """The simulator takes its workloads from ``router.workloads``: nothing it runs, and
    no import it names (type-only ones included), is in ``router.bench``."""
    modules = _modules()
    sim = {name for name in modules if name == "router.sim" or name.startswith("router.sim.")}
    reached = _reachable(import_graph(), sim)
    assert not {m for m in reached if m == "router.bench" or m.startswith("router.bench.")}
    for name in sim:
        for node in ast.walk(ast.parse(modules[name].read_text())):
            if isinstance(node, ast.ImportFrom):
                named = {node.module or ""}
            elif isinstance(node, ast.Import):
                named = {alias.name for alias in node.names}
            else:
                continue
            assert not {n for n in named if n.startswith("router.bench")}, name


#: The package of the front ends (transport adapters), and the wiring that builds them:
#: the only modules outside it that may import one. (``router.cli`` names the sidecar's
#: module as a string, imported only for its command.)
FRONT_ENDS = "router.frontends"
WIRING = frozenset({"router.app", "router.serve"})


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _named(tree: ast.AST, module: str, package: bool) -> Iterator[list[str]]:
    """For every import in ``tree`` (at module level, inside functions and under ``if
    TYPE_CHECKING:``), the modules it may name: its target, then each name it takes from
    the target as a possible submodule (``from router import frontends``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield [alias.name]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: None if package else -1]
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            yield [target, *(f"{target}.{alias.name}" for alias in node.names)]


def front_end_imports(modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(importer, front end) for every import of a front end by a module outside the
    front ends and the wiring, type-only and function-level imports included."""
    found = []
    for name, path in sorted(modules.items()):
        if _in(name, FRONT_ENDS) or name in WIRING:
            continue
        tree = ast.parse(path.read_text())
        for named in _named(tree, name, path.name == "__init__.py"):
            hit = next((target for target in named if _in(target, FRONT_ENDS)), None)
            if hit is not None:
                found.append((name, hit))
    return found


def test_no_module_outside_the_front_ends_and_the_wiring_imports_a_front_end() -> None:
    """The serving pipeline, the handoffs, the index and everything else know no
    transport: a front end depends on them, never the other way, not even for a type."""
    found = front_end_imports(_modules())
    assert not found, "imports of a front end: " + ", ".join(f"{a} imports {b}" for a, b in found)


def test_a_front_end_import_is_found_under_type_checking_and_in_a_function(
    tmp_path: Path,
) -> None:
    sources = {
        "router.serving.gate": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from router.frontends.http.routes import HttpApi\n"
        ),
        "router.handoff.base": "def later():\n    from ..frontends import sidecar\n",
        "router.app": "from router.frontends.http.server import HttpServer\n",
        "router.frontends.extproc": "from router.frontends.grpc import api\n",
    }
    modules = {}
    for name, source in sources.items():
        modules[name] = tmp_path / f"{name}.py"
        modules[name].write_text(source)
    assert front_end_imports(modules) == [
        ("router.handoff.base", "router.frontends"),
        ("router.serving.gate", "router.frontends.http.routes"),
    ]


def test_a_cycle_is_found_and_printed_in_order() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_front_ends_read_only_what_services_holds() -> None:
    """Every ``app.<name>`` the front ends read is a piece of :class:`Services`: a new
    dependency is added there, visibly, not reached for through the application."""
    from router.serving.services import Services

    # Its fields, properties and methods.
    held = set(Services.__dataclass_fields__) | {n for n in vars(Services) if n[0] != "_"}
    modules = _modules()
    readers = (
        "router.frontends.extproc",
        "router.frontends.grpc.api",
        "router.frontends.http.anthropic",
        "router.frontends.http.passthrough",
        "router.frontends.http.responses_api",
        "router.frontends.http.routes",
        "router.serving.split",
    )
    for name in readers:
        tree = ast.parse(modules[name].read_text())
        read = {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and (
                (isinstance(node.value, ast.Name) and node.value.id == "app")
                or (
                    isinstance(node.value, ast.Attribute)
                    and node.value.attr == "app"
                    and isinstance(node.value.value, ast.Name)
                    and node.value.value.id in ("self", "api")
                )
            )
        }
        assert read, name  # the check sees the reads
        assert read <= held, (name, sorted(read - held))
