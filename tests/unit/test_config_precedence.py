"""`kvroute serve`'s one configuration object: defaults < YAML < environment < flags,
and a bad value is refused naming its field."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from router.config import ConfigError, load_config
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


def test_a_misspelt_key_suggests_the_right_one_and_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(
        "policy:\n  prefil_weight: 2\nengines:\n  - url: http://10.0.0.1:8000\n    rol: both\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    text = str(err.value)
    assert (
        f"policy.prefil_weight: Extra inputs are not permitted; did you mean prefill_weight? "
        f"(in {path})" in text
    )
    assert "engines.0.rol: Extra inputs are not permitted; did you mean role?" in text


def test_a_key_far_from_any_gets_no_suggestion(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("server:\n  colour: blue\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert "server.colour: Extra inputs are not permitted (in" in str(err.value)
    assert "did you mean" not in str(err.value)


def test_a_bad_key_from_the_environment_names_the_variable_not_the_file(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("policy:\n  name: kv_cost\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={"KVROUTE_POLCY__NAME": "kv_cost"})
    text = str(err.value)
    assert "polcy: Extra inputs are not permitted; did you mean policy?" in text
    assert "(from environment variable KVROUTE_POLCY__NAME)" in text
    assert str(path) not in text
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={"KVROUTE_POLICY__NAME": "fastest"})
    assert "(from environment variable KVROUTE_POLICY__NAME)" in str(err.value)


def test_a_bad_flag_value_is_blamed_on_the_flag(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("server:\n  port: 9001\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, {"server": {"port": 99_999}}, environ={})
    assert "server.port:" in str(err.value) and "(from a command-line flag)" in str(err.value)


def test_a_yaml_error_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("policy:\n  name: [kv_cost\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert f'in "{path}", line 2' in str(err.value)
    assert "<unicode string>" not in str(err.value)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KVROUTE_SERVICE_HOST", "10.96.12.34"),
        ("KVROUTE_SERVICE_PORT", "8000"),
        ("KVROUTE_SERVICE_PORT_HTTP", "8000"),
        ("KVROUTE_PORT", "tcp://10.96.12.34:8000"),
        ("KVROUTE_PORT_8000_TCP", "tcp://10.96.12.34:8000"),
        ("KVROUTE_PORT_8000_TCP_PROTO", "tcp"),
        ("KVROUTE_PORT_8000_TCP_PORT", "8000"),
        ("KVROUTE_PORT_8000_TCP_ADDR", "10.96.12.34"),
        ("KVROUTE_GRPC_PORT_9003_UDP", "udp://[fd00::12]:9003"),
        ("KVROUTE_REDIS_SERVICE_HOST", "fd00::7"),
    ],
)
def test_kubernetes_service_links_are_not_configuration(name: str, value: str) -> None:
    config = load_config(environ={name: value})
    assert config == load_config(environ={})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        # Misspelt settings that only look like links: each is still refused by name.
        ("KVROUTE_PORT", "8000"),
        ("KVROUTE_SERVER_PORT", "9000"),
        ("KVROUTE_SERVICE_HOST", "router.example"),
        ("KVROUTE_PORT_8000_TCP", "tcp://10.96.12.34:9000"),
        ("KVROUTE_PORT_8000_TCP_PROTO", "udp"),
        ("KVROUTE_PORT_8000_TCP_PORT", "8001"),
        ("KVROUTE_PORT_8000_TCP_ADDR", "localhost"),
        ("KVROUTE_SERVICE_PORT", "99999"),
    ],
)
def test_a_variable_that_only_looks_like_a_service_link_is_refused(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"from environment variable {name}"):
        load_config(environ={name: value})


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.5:8000/v1",
        "http://10.0.0.5:8000/v1/",
        "http://10.0.0.5:8000/openai/v1",
        "http://10.0.0.5:8000/?model=x",
    ],
)
def test_an_engine_url_with_a_path_is_refused_naming_the_root_to_give(url: str) -> None:
    # The OpenAI base-URL habit: accepted, it would never become ready (/v1/health: 404).
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"engines": [{"url": url}]}, environ={})
    assert (
        f"engines.0.url: Value error, engine url {url} has a path: give the engine "
        "server's root, http://10.0.0.5:8000 (the router adds /v1/..., /health" in str(err.value)
    )


def test_an_engine_root_url_may_end_in_a_slash() -> None:
    config = load_config(overrides={"engines": [{"url": "http://10.0.0.5:8000/"}]}, environ={})
    assert config.engines[0].url == "http://10.0.0.5:8000"


def test_a_bad_engine_flag_is_blamed_on_the_flag_not_the_file(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("engines:\n  - url: http://10.0.0.1:8000\n")
    with pytest.raises(ConfigError) as err:
        config_from_args(parse("--config", str(path), "--engine", "10.0.0.2:8000"))
    assert str(err.value).splitlines()[1:] == [
        "  engines.1.url: Value error, engine url must look like http://host:port "
        "(from a command-line flag)"
    ]
