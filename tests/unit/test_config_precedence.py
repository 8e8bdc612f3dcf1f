"""`kvroute serve`'s one configuration object: defaults < YAML < environment < flags,
and a bad value is refused naming its field."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from router.config import ConfigError
from router.serve import add_arguments, config_from_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_override_the_environment_which_overrides_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(
        "server:\n  port: 9001\n  log_level: warning\npolicy:\n  name: round_robin\n"
        "  prefill_weight: 5\nengines:\n  - url: http://10.0.0.1:8000\n"
    )
    for name in [n for n in os.environ if n.startswith("KVROUTE_")]:
        monkeypatch.delenv(name)
    args = parse("--config", str(path))
    config = config_from_args(args)
    assert (config.server.port, config.policy.name, config.policy.prefill_weight) == (
        9001,
        "round_robin",
        5,
    )

    monkeypatch.setenv("KVROUTE_POLICY__NAME", "random")
    monkeypatch.setenv("KVROUTE_SERVER__PORT", "9002")
    config = config_from_args(parse("--config", str(path)))
    assert (config.server.port, config.policy.name, config.policy.prefill_weight) == (
        9002,
        "random",
        5,
    )

    args = parse(
        "--config",
        str(path),
        "--policy",
        "least_loaded",
        "--port",
        "0",
        "--log-level",
        "debug",
        "--engine",
        "http://10.0.0.2:8000",
    )
    config = config_from_args(args)
    assert (config.server.port, config.policy.name, config.server.log_level) == (
        0,
        "least_loaded",
        "debug",
    )
    assert [e.url for e in config.engines] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


def test_a_bad_value_is_refused_naming_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVROUTE_POLICY__NAME", "fastest")
    with pytest.raises(ConfigError, match=r"policy\.name"):
        config_from_args(parse("--engine", "http://10.0.0.2:8000"))
