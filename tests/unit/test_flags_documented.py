"""Every flag of ``kvroute engine`` is in docs/engine-emulator.md, and every flag of
``kvroute serve`` is in README.md."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from router import serve
from router.emulator import cli as engine_cli

ROOT = Path(__file__).resolve().parents[2]


def flags(add_arguments) -> list[str]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return sorted(
        option
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    )


@pytest.mark.parametrize(
    ("add_arguments", "doc"),
    [(engine_cli.add_arguments, "docs/engine-emulator.md"), (serve.add_arguments, "README.md")],
    ids=["kvroute engine", "kvroute serve"],
)
def test_every_flag_is_documented(add_arguments, doc: str) -> None:
    text = (ROOT / doc).read_text()
    # In code quotes, whole: `--kv-events` would not count for `--kv-events-topic`.
    missing = [flag for flag in flags(add_arguments) if not re.search(f"`{flag}(?![\\w-])", text)]
    assert len(flags(add_arguments)) > 10
    assert not missing, f"{doc} does not describe {missing}"


def test_every_policy_name_serve_takes_is_in_the_readme() -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    (policy,) = [a for a in parser._actions if "--policy" in a.option_strings]
    text = (ROOT / "README.md").read_text()
    usage = re.search(r"\[--policy ([a-z_|]+)\]", text)
    assert usage, "the README's serve usage lists the policies"
    documented = set(usage.group(1).split("|")) | set(re.findall(r"`([a-z_]+)`", text))
    assert not set(policy.choices) - documented  # `default` too: what is it?
