"""What ships: kvroute's runtime dependencies are exactly what ``kvroute serve`` imports.

The serve path is read from the source (tests/support/imports.py): ``router.cli`` and
``router.serve`` and every kvroute module they can import, at module level or inside a
function, ``if TYPE_CHECKING`` blocks excepted. The emulated engine, the benchmarks
and plotting are extras, and a command that needs a missing extra says which in one line.
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from functools import cache
from pathlib import Path

import pytest
from support.imports import ROOT, Imports, reachable
from support.listener import CountingListener

from router.cli import EXTRA_PACKAGES

if sys.version_info >= (3, 11):
    import tomllib
else:  # the test extra's tomli
    import tomli as tomllib

SERVE_ROOTS = ("router.cli", "router.serve")

#: Distribution name -> the top-level import names it provides that kvroute uses.
IMPORT_NAMES: dict[str, set[str]] = {
    "aiohttp": {"aiohttp"},
    "uvloop": {"uvloop"},
    "httptools": {"httptools"},
    "msgspec": {"msgspec"},
    "pydantic": {"pydantic"},
    "pyyaml": {"yaml"},
    "pyzmq": {"zmq"},
    "xxhash": {"xxhash"},
    "redis": {"redis"},
    "prometheus-client": {"prometheus_client"},
    "tokenizers": {"tokenizers"},
    "huggingface-hub": {"huggingface_hub"},
    "jinja2": {"jinja2"},
    "grpcio": {"grpc"},
    "grpcio-health-checking": {"grpc_health"},
    "grpcio-reflection": {"grpc_reflection"},
    "protobuf": {"google"},
    "xds-protos": {"envoy", "udpa", "xds", "validate"},
    "kubernetes-asyncio": {"kubernetes_asyncio"},
    "starlette": {"starlette"},
    "uvicorn": {"uvicorn"},
    "matplotlib": {"matplotlib"},
    "fastapi": {"fastapi"},
    "httpx": {"httpx"},
    "opentelemetry-api": {"opentelemetry"},
    "opentelemetry-sdk": {"opentelemetry"},
    "opentelemetry-exporter-otlp-proto-http": {"opentelemetry"},
}
#: Runtime dependencies no kvroute module imports, and why they are there.
USED_BY_OTHERS = {
    "hiredis": "redis-py's reply parser (the redis[hiredis] extra), used by redis-py",
}
#: Packages the serve path imports that come with a runtime dependency, which pins them.
COMES_WITH = {"pydantic_core": "pydantic"}
#: Extras the serve path may import from, inside functions only, when a setting asks
#: for them (tracing.enabled: the otel extra).
EXTRAS_ON_SERVE = {"otel"}


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match, requirement
    return match.group(0).lower().replace("_", "-")


def _extras_of(requirement: str) -> set[str]:
    match = re.match(r"[A-Za-z0-9._-]+\[([^\]]*)\]", requirement)
    return {e.strip() for e in match.group(1).split(",")} if match else set()


PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
RUNTIME = {_name(r): r for r in PROJECT["dependencies"]}
EXTRAS: dict[str, list[str]] = PROJECT["optional-dependencies"]


@cache
def _serve_path() -> dict[str, Imports]:
    return reachable(SERVE_ROOTS)


def test_every_runtime_dependency_has_known_import_names() -> None:
    unknown = sorted(set(RUNTIME) - IMPORT_NAMES.keys() - USED_BY_OTHERS.keys())
    assert not unknown, f"add these to IMPORT_NAMES (distribution -> import names): {unknown}"


def test_the_serve_path_imports_only_runtime_dependencies() -> None:
    allowed = set().union(*(IMPORT_NAMES.get(dist, set()) for dist in RUNTIME))
    allowed |= {name for name, dist in COMES_WITH.items() if dist in RUNTIME}
    on_serve_extras = {pkg for pkg, extra in EXTRA_PACKAGES.items() if extra in EXTRAS_ON_SERVE}
    stray: dict[str, list[str]] = {}
    for module, found in _serve_path().items():
        for package in found.packages | found.optional_packages:
            if package in allowed:
                continue
            if package in on_serve_extras and package in found.deferred_packages:
                continue
            stray.setdefault(package, []).append(module)
    assert not stray, f"imported on the serve path but not a runtime dependency: {stray}"


def test_every_runtime_dependency_is_imported_on_the_serve_path() -> None:
    imported = set().union(*(f.packages | f.optional_packages for f in _serve_path().values()))
    unused = sorted(
        dist
        for dist in RUNTIME
        if dist not in USED_BY_OTHERS and not IMPORT_NAMES.get(dist, set()) & imported
    )
    assert not unused, f"runtime dependencies `kvroute serve` never imports: {unused}"


def test_the_reasons_for_unimported_dependencies_still_hold() -> None:
    assert "hiredis" in _extras_of(RUNTIME["redis"])
    assert set(USED_BY_OTHERS) <= {"hiredis"} | set(RUNTIME)


def test_no_extra_package_is_a_runtime_dependency() -> None:
    for package in ("fastapi", "uvicorn", "starlette", "matplotlib", "numpy", "httpx"):
        assert package not in RUNTIME


def test_the_cli_names_the_extra_each_package_comes_with() -> None:
    """``router.cli.EXTRA_PACKAGES`` agrees with pyproject.toml's extras."""

    def closure(extra: str) -> set[str]:  # an extra with the extras it includes
        out = {extra}
        for requirement in EXTRAS[extra]:
            if _name(requirement) == "kvroute":
                for inner in _extras_of(requirement):
                    out |= closure(inner)
        return out

    for package, extra in EXTRA_PACKAGES.items():
        dists = {_name(r) for e in closure(extra) for r in EXTRAS[e] if _name(r) != "kvroute"}
        assert any(package in IMPORT_NAMES.get(d, set()) for d in dists), (package, extra)
    for extra in ("engine", "bench"):
        for requirement in EXTRAS[extra]:
            dist = _name(requirement)
            if dist != "kvroute":
                assert any(EXTRA_PACKAGES.get(name) == extra for name in IMPORT_NAMES[dist])


def test_the_makefile_venv_installs_the_extras_the_suite_needs() -> None:
    makefile = (ROOT / "Makefile").read_text()
    line = next(line for line in makefile.splitlines() if "pip install" in line and "-e" in line)
    assert {"test", "bench"} <= set(re.search(r"\.\[([^\]]*)\]", line).group(1).split(","))


def test_the_image_installs_kvroute_without_extras_by_default() -> None:
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.search(r"^ARG EXTRAS=\"\"$", dockerfile, re.M)


# ------------------------------------------------------------------------- without extras

#: Run in a fresh interpreter: the packages of every extra fail to import, as they
#: would where only ``pip install kvroute`` ran.
BLOCK_EXTRAS = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
"""


def _without_extras(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_EXTRAS + code, ",".join(EXTRA_PACKAGES), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_every_module_on_the_serve_path_imports_without_the_extras() -> None:
    modules = sorted(_serve_path())
    code = "import importlib\nfor m in sys.argv[2:]: importlib.import_module(m)\n"
    done = _without_extras(code, *modules)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "command", ["serve", "sidecar", "indexer", "bench", "simulate", "plan", "config", "status"]
)
def test_commands_other_than_engine_start_without_the_extras(command: str) -> None:
    code = "from router.cli import main; sys.exit(main([sys.argv[2], '--help']))"
    done = _without_extras(code, command)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: kvroute {command}")


@pytest.mark.parametrize(
    ("argv", "extra"),
    [(["engine", "--help"], "engine"), (["engine", "--port", "0"], "engine")],
)
def test_a_command_without_its_extra_says_which_to_install(argv: list[str], extra: str) -> None:
    done = _without_extras("from router.cli import main; sys.exit(main(sys.argv[2:]))", *argv)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert re.fullmatch(
        rf"kvroute engine needs the '{extra}' extra \((starlette|uvicorn) is not installed\): "
        rf"pip install 'kvroute\[{extra}\]'",
        line,
    )


def test_the_command_list_shows_without_the_extras() -> None:
    done = _without_extras("from router.cli import main; sys.exit(main(['--help']))")
    assert done.returncode == 0, done.stderr
    assert "engine" in done.stdout and "serve" in done.stdout


def test_a_package_a_command_imports_as_it_runs_is_named_too() -> None:
    """bench's plots import matplotlib when they are drawn, long after the command began."""
    code = (
        "import types, router.cli\n"
        "plots = types.ModuleType('plots')\n"
        "plots.add_arguments = lambda parser: None\n"
        "def run(args):\n"
        "    import matplotlib\n"
        "plots.run = run\n"
        "sys.modules['plots'] = plots\n"
        "router.cli.COMMANDS['plots'] = ('plots', 'draw plots')\n"
        "sys.exit(router.cli.main(['plots']))\n"
    )
    done = _without_extras(code)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "kvroute plots needs the 'bench' extra (matplotlib is not installed): "
        "pip install 'kvroute[bench]'"
    )


def test_the_serve_roots_exist() -> None:
    for root in SERVE_ROOTS:
        assert (ROOT / Path(*root.split("."))).with_suffix(".py").exists()


def test_the_package_metadata_is_read_without_deprecation_warnings() -> None:
    """The SPDX license string of PEP 639 (a license table is deprecated in setuptools,
    unsupported after 2027-02-18), and a build requirement on a setuptools that reads it."""
    from packaging.requirements import Requirement
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), str(ROOT / "pyproject.toml"))
    assert [str(w.message).splitlines()[0] for w in caught] == []
    assert dist.metadata.license_expression == "Apache-2.0"
    assert dist.metadata.license_files == ["router/native/LICENSE.xxhash"]
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]
    (setuptools,) = [Requirement(r) for r in build["requires"] if _name(r) == "setuptools"]
    assert "76.9" not in setuptools.specifier and "77.0" in setuptools.specifier


def test_bench_without_its_plots_package_says_so_before_sending_anything(
    tmp_path: Path,
) -> None:
    target = CountingListener()  # what bench would send the workload to
    try:
        done = _without_extras(
            "from router.cli import main; sys.exit(main(sys.argv[2:]))",
            *("bench", "--target", f"http://127.0.0.1:{target.port}", "--workload"),
            *("shared-prefix", "--groups", "1", "--prompts-per-group", "2"),
            *("--output", str(tmp_path)),
        )
    finally:
        target.close()
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "kvroute bench: the plots need the 'bench' extra (matplotlib is not installed): "
        "pip install 'kvroute[bench]', or run with --no-plots"
    )
    assert (done.stdout, target.accepted) == ("", 0)
