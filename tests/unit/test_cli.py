"""The command line: every flag documented, ``kvroute config check``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from router.cli import COMMANDS, _parser, main


def _flags(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str, argparse.Action]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.extend(_flags(sub, f"{prefix} {name}"))
        elif not isinstance(action, argparse._HelpAction):
            found.append((prefix, action))
    return found


def test_every_flag_of_every_command_has_help() -> None:
    parser = _parser(None)  # imports every command's module, as ``kvroute --help`` does
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(COMMANDS)
    flags = _flags(parser, "kvroute")
    assert len(flags) > 50
    missing = [
        f"{where} {'/'.join(a.option_strings) or a.dest}"
        for where, a in flags
        if not a.help or a.help == argparse.SUPPRESS
    ]
    assert not missing, f"flags without --help text: {missing}"


def test_config_check_prints_the_effective_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("policy:\n  prefill_weight: 3\nengines:\n  - url: http://10.0.0.5:8000\n")
    monkeypatch.setenv("KVROUTE_LIMITS__MAX_INFLIGHT", "50")
    assert main(["config", "check", str(path), "--format", "json"]) == 0
    values = json.loads(capsys.readouterr().out)
    assert values["policy"]["prefill_weight"] == 3
    assert values["policy"]["queue_weight"] == 1.0  # a default, filled in
    assert values["limits"]["max_inflight"] == 50  # from the environment
    assert values["engines"][0]["role"] == "both"
    assert main(["config", "check", str(path), "--no-env", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["limits"]["max_inflight"] == 10_000


def test_config_check_names_what_is_wrong_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("policy:\n  prefill_weight: -1\nserver:\n  colour: blue\n")
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "policy.prefill_weight" in err and "server.colour" in err
    assert main(["config", "check", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read configuration file" in capsys.readouterr().err
    path.write_text("[1, 2]")
    assert main(["config", "check", str(path)]) == 2
    assert "mapping at the top level" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "abbreviated"),
    [
        (["plan", "--cache", "100"], "--cache"),  # --cache-blocks
        (["simulate", "--output-tok", "4"], "--output-tok"),  # --output-tokens
        (["config", "check", "--form", "json", "router.yaml"], "--form"),  # --format
    ],
)
def test_an_abbreviated_flag_is_refused_not_guessed(
    argv: list[str], abbreviated: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert f"unrecognized arguments: {abbreviated}" in capsys.readouterr().err


def test_config_check_says_an_unset_block_size_is_the_engines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("engines:\n  - url: http://10.0.0.5:8000\n")
    assert main(["config", "check", str(path), "--no-env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("# block_size is not set: each model's pool takes the block size")
    assert lines[2] == "block_size: 16"
    assert main(["config", "check", str(path), "--no-env", "--format", "json"]) == 0
    assert "note: block_size is not set" in capsys.readouterr().err
    path.write_text("block_size: 32\nengines:\n  - url: http://10.0.0.5:8000\n")
    assert main(["config", "check", str(path), "--no-env"]) == 0
    assert "block_size is not set" not in capsys.readouterr().out


def test_serve_help_says_the_block_size_comes_from_the_engines() -> None:
    parser = _parser("serve")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    (flag,) = [a for a in sub.choices["serve"]._actions if "--block-size" in a.option_strings]
    assert flag.help is not None and "first engine reports" in flag.help
