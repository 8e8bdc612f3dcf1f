"""Renamed configuration keys: the Redis settings live under ``index.redis``, and their
old names directly under ``index`` keep working, from every source, with a warning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.docs import DOCS

from router.cli import main
from router.config import RENAMED_KEYS, Config, ConfigError, IndexConfig, load_config

OLD = {"backend": "redis", "url": "redis://old-host:6379/1", "namespace": "old", "budget_ms": 9}


def write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def no_kvroute_env() -> dict[str, str]:
    """This process's environment without ``KVROUTE_*`` (which would set config)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}


def test_the_redis_settings_are_read_from_index_redis(tmp_path: Path) -> None:
    redis = {"url": "redis://new-host:6379/2", "namespace": "new", "budget_ms": 12}
    path = write(tmp_path, {"index": {"backend": "redis", "redis": redis}})
    config = load_config(path, environ={})
    assert config.index.redis.url == "redis://new-host:6379/2"
    assert (config.index.redis.namespace, config.index.redis.budget_ms) == ("new", 12)
    assert config.deprecations == []


def test_old_keys_still_work_and_each_is_reported_with_where_it_was_set(tmp_path: Path) -> None:
    path = write(tmp_path, {"index": OLD})
    config = load_config(path, environ={})
    redis = config.index.redis
    assert (redis.url, redis.namespace, redis.budget_ms) == ("redis://old-host:6379/1", "old", 9)
    assert config.deprecations == [
        f"configuration key index.{key} (in {path}) is deprecated: use index.redis.{key}"
        for key in ("url", "namespace", "budget_ms")
    ]
    # What the configuration shows (config check, reloads) has the new names only.
    assert set(config.model_dump()["index"]) == {
        "backend",
        "max_entries",
        "max_entries_per_engine",
        "shadow_window_s",
        "shadow_max_keys",
        "redis",
        "replicated",
    }


def test_an_old_key_from_the_environment_still_works_and_names_its_variable() -> None:
    config = load_config(
        environ={"KVROUTE_INDEX__BUDGET_MS": "7", "KVROUTE_INDEX__SHARE_LOAD": "false"}
    )
    assert config.index.redis.budget_ms == 7 and config.index.redis.share_load is False
    assert any(
        "KVROUTE_INDEX__BUDGET_MS" in note and "index.redis.budget_ms" in note
        for note in config.deprecations
    )
    assert len(config.deprecations) == 2


def test_new_keys_from_the_environment_work() -> None:
    config = load_config(environ={"KVROUTE_INDEX__REDIS__NAMESPACE": "from-env"})
    assert config.index.redis.namespace == "from-env" and config.deprecations == []


def test_old_keys_given_as_overrides_work_like_flags() -> None:
    config = load_config(overrides={"index": {"load_interval_s": 0.2}}, environ={})
    assert config.index.redis.load_interval_s == 0.2
    assert config.deprecations == [
        "configuration key index.load_interval_s (from a command-line flag) is deprecated: "
        "use index.redis.load_interval_s"
    ]


def test_an_old_and_a_new_key_set_differently_are_refused_naming_both_sources(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, {"index": {"url": "redis://a:6379/0"}})
    env = {"KVROUTE_INDEX__REDIS__URL": "redis://b:6379/0"}
    with pytest.raises(ConfigError) as refused:
        load_config(path, environ=env)
    message = str(refused.value)
    assert f"index.url (in {path}) and index.redis.url (from environment variable " in message
    assert "KVROUTE_INDEX__REDIS__URL) are both set, to different values" in message
    assert "set only index.redis.url" in message


def test_an_old_and_a_new_key_set_alike_are_accepted(tmp_path: Path) -> None:
    path = write(tmp_path, {"index": {"namespace": "same", "redis": {"namespace": "same"}}})
    config = load_config(path, environ={})
    assert config.index.redis.namespace == "same"
    assert len(config.deprecations) == 1


def test_a_bad_value_under_an_old_name_is_named_both_ways_and_blamed_on_its_source(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, {"index": {"budget_ms": -1}})
    with pytest.raises(ConfigError) as refused:
        load_config(path, environ={})
    message = str(refused.value)
    assert "index.redis.budget_ms (set as index.budget_ms)" in message
    assert f"greater than 0 (in {path})" in message


def test_old_keys_work_where_a_configuration_is_built_in_code() -> None:
    assert IndexConfig(backend="redis", namespace="direct").redis.namespace == "direct"
    config = Config.model_validate({"index": {"url": "redis://code:6379/0"}})
    assert config.index.redis.url == "redis://code:6379/0"
    with pytest.raises(ValueError, match=r"index\.url and index\.redis\.url are both set"):
        IndexConfig(url="redis://a:6379/0", redis={"url": "redis://b:6379/0"})


def test_published_load_must_still_outlive_the_exchange_interval_under_old_names() -> None:
    with pytest.raises(ConfigError, match="load_ttl_s must be longer"):
        load_config(overrides={"index": {"load_interval_s": 0.5, "load_ttl_s": 0.5}}, environ={})


def test_every_renamed_key_is_documented_with_its_replacement() -> None:
    text = (DOCS / "configuration.md").read_text()
    missing = [old for old, new in RENAMED_KEYS.items() if f"| `{old}` | `{new}` |" not in text]
    assert not missing


def test_config_check_warns_of_old_keys_and_prints_the_new_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, {"index": OLD, "engines": [{"url": "http://10.0.0.5:8000"}]})
    assert main(["config", "check", str(path), "--no-env"]) == 0
    captured = capsys.readouterr()
    assert "warning: configuration key index.url" in captured.err
    assert "use index.redis.url" in captured.err
    shown = yaml.safe_load(captured.out)["index"]
    assert shown["redis"]["url"] == "redis://old-host:6379/1" and "url" not in shown


@pytest.mark.parametrize(
    ("command", "refusal"),
    [("serve", "no engines"), ("indexer", "indexer.engines lists no engine")],
)
def test_the_commands_log_each_old_key_once_at_start(
    tmp_path: Path, command: str, refusal: str
) -> None:
    # Neither gets as far as serving: the configuration has no engines to follow.
    path = write(tmp_path, {"index": OLD})
    done = subprocess.run(
        [sys.executable, "-m", "router", command, "--config", str(path)],
        capture_output=True,
        text=True,
        env=no_kvroute_env(),
        timeout=60,
    )
    assert done.returncode == 2
    assert refusal in done.stderr
    assert done.stderr.count("configuration key index.url") == 1
    assert done.stderr.count("is deprecated") == 3
