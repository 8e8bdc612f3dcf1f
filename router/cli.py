"""``kvroute`` command line: one subcommand per module, each owning its flags.

A command module exposes ``add_arguments(parser)`` and ``run(args) -> int``; add it to
``COMMANDS`` below. Modules are imported only for the command being run (and for
``--help``), so one command's heavy imports never slow another's start-up.

A command whose packages come with an extra (``kvroute engine``: ``engine``; bench's
plots: ``bench``) says in one line which extra to install when they are missing.
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import sys
from collections.abc import Sequence
from typing import Any

from router import __version__

#: command name -> (module path, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("router.serve", "Run the router (OpenAI-compatible HTTP API)"),
    "engine": ("router.emulator.cli", "Run an emulated vLLM-compatible engine"),
    "sidecar": (
        "router.frontends.sidecar",
        "Run in front of a decode pod's engine (llm-d P/D sidecar)",
    ),
    "indexer": ("router.events.indexer", "Write engines' KV events into the shared Redis index."),
    "bench": ("router.bench.cli", "Replay a workload against targets; compare them side by side"),
    "simulate": ("router.sim.cli", "Replay a workload on a simulated fleet (virtual clock)"),
    "plan": (
        "router.sim.capacity",
        "Search prefill:decode ratios for the best goodput within SLOs",
    ),
    "config": ("router.config_cli", "Check a configuration file and print the effective values"),
    "status": ("router.status", "Show a running router's engines: state, load, index share"),
}

#: Packages (import names) that come with an optional extra, not with ``kvroute`` itself
#: (pyproject.toml): import name -> extra.
EXTRA_PACKAGES: dict[str, str] = {
    "starlette": "engine",
    "uvicorn": "engine",
    "matplotlib": "bench",
    "fastapi": "bench",
    "httpx": "bench",
    "opentelemetry": "otel",
}


class MissingExtra(Exception):
    """A command needs a package of an extra that is not installed."""

    def __init__(self, command: str, exc: ModuleNotFoundError) -> None:
        package = (exc.name or "").split(".")[0]
        self.extra = EXTRA_PACKAGES[package]
        super().__init__(
            f"kvroute {command} needs the '{self.extra}' extra ({package} is not installed): "
            f"pip install 'kvroute[{self.extra}]'"
        )


def _needs_extra(exc: ModuleNotFoundError) -> bool:
    """Whether the missing module is a package of an extra."""
    return (exc.name or "").split(".")[0] in EXTRA_PACKAGES


class _Parser(argparse.ArgumentParser):
    """Long flags only as spelt: argparse would take ``--output`` for the one flag it
    begins (``--output-tokens``) in a command without ``--output``, and every new flag
    would break the abbreviations it begins. Subcommands' parsers are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def _parser(selected: str | None) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvroute",
        description="Cache-aware request router for disaggregated LLM inference fleets.",
    )
    parser.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_path, help_text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        if selected in (None, name):
            try:
                module = importlib.import_module(module_path)
            except ModuleNotFoundError as exc:
                if not _needs_extra(exc):
                    raise
                if selected == name:
                    raise MissingExtra(name, exc) from exc
                cmd.description = f"{help_text} ({MissingExtra(name, exc)})"
                continue
            module.add_arguments(cmd)
            cmd.set_defaults(_run=module.run)
    return parser


def _stdout_gone() -> bool:
    """Whether stdout's reader left (``kvroute status --json | head``); if so stdout now
    goes to /dev/null, so the flush at exit does not print a traceback about it either."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's capture)
        return False
    if hasattr(select, "poll"):  # a pipe with no reader polls as an error (Linux, BSD)
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        if not any(events & select.POLLERR for _, events in poller.poll(0)):
            return False  # another pipe broke: not for this handler to hide
    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in args_list if not a.startswith("-")), None)
    try:
        parser = _parser(selected)
        args = parser.parse_args(args_list)
        if not getattr(args, "_run", None):
            parser.print_help()
            return 2
        return int(args._run(args) or 0)
    except MissingExtra as exc:
        print(exc, file=sys.stderr)
        return 2
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        return 1
    except ModuleNotFoundError as exc:  # imported lazily by the command (bench's plots)
        if not _needs_extra(exc) or selected is None:
            raise
        print(MissingExtra(selected, exc), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
