"""Credential checks and peer parsing without a network."""

from __future__ import annotations

import re
from typing import Any

import pytest

from router.config import AuthConfig, Config, ConfigError, load_config
from router.handoff.fields import OWNED_PATHS, owned_fields, strip_owned
from router.index.redis import RedisIndex
from router.redaction import redacted
from router.security import (
    AuthError,
    Credentials,
    bearer,
    endpoint_allowed,
    engine_allowed,
    is_loopback,
)


@pytest.mark.parametrize(
    ("peer", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("ipv4:127.0.0.1:5000", True),
        ("ipv6:[::1]:5000", True),
        ("unix:/tmp/sock", True),
        ("10.0.0.1", False),
        ("ipv4:10.1.2.3:443", False),
        ("ipv6:[fe80::1%eth0]:80", False),
        ("", False),
        (None, False),
        ("garbage", False),
    ],
)
def test_loopback_peers(peer: str | None, loopback: bool) -> None:
    assert is_loopback(peer) is loopback


def test_bearer_tokens() -> None:
    assert bearer("Bearer abc") == b"abc"
    assert bearer("bearer  abc ") == b"abc"
    assert bearer("Basic abc") is None
    assert bearer("Bearer ") is None
    assert bearer(None) is None


def test_without_admin_keys_only_loopback_may_administer() -> None:
    creds = Credentials(AuthConfig())
    creds.check_admin(None, "ipv4:127.0.0.1:1")
    with pytest.raises(AuthError) as err:
        creds.check_admin("Bearer anything", "ipv4:10.0.0.7:1")
    assert err.value.status == 403 and "admin_keys" in err.value.message
    creds.check_client(None)  # no client keys: open


def test_key_files_comments_and_reload(tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# clients\nalpha\n\n  beta  \n")
    creds = Credentials(AuthConfig(api_keys_file=keys, admin_keys=["root"]))
    creds.check_client("Bearer beta")
    creds.check_client("Bearer root")  # an admin key is also a client key
    with pytest.raises(AuthError):
        creds.check_client("Bearer # clients")
    keys.write_text("gamma\n")
    creds.reload(AuthConfig(api_keys_file=keys, admin_keys=["root"]))
    with pytest.raises(AuthError):
        creds.check_client("Bearer beta")
    creds.check_client("Bearer gamma")


@pytest.mark.parametrize("content", ["", "\n\n", "# rotated out\n   \n"])
def test_a_key_file_without_keys_fails_closed(tmp_path, content: str) -> None:
    keys = tmp_path / "keys"
    keys.write_text(content)
    for auth in (AuthConfig(api_keys_file=keys), AuthConfig(admin_keys_file=keys)):
        with pytest.raises(ConfigError, match=re.escape(f"_keys_file: {keys} holds no keys")):
            Credentials(auth)
    with pytest.raises(ConfigError, match=r"auth\.upstream_token_file"):
        Credentials(AuthConfig(upstream="token", upstream_token_file=keys))
    with pytest.raises(ConfigError, match=r"auth\.api_keys: every key is blank"):
        Credentials(AuthConfig(api_keys=["  "]))


def test_a_reload_to_a_key_file_without_keys_keeps_the_running_keys(tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("alpha\n")
    creds = Credentials(AuthConfig(api_keys_file=keys))
    keys.write_text("")
    with pytest.raises(ConfigError, match="holds no keys"):
        creds.reload(AuthConfig(api_keys_file=keys))
    assert not creds.client_open
    creds.check_client("Bearer alpha")
    with pytest.raises(AuthError):
        creds.check_client(None)


def test_upstream_modes() -> None:
    assert Credentials(AuthConfig()).upstream_authorization("Bearer c") == "Bearer c"
    assert Credentials(AuthConfig(upstream="drop")).upstream_authorization("Bearer c") is None
    token = Credentials(AuthConfig(upstream="token", upstream_token="e"))
    assert token.upstream_authorization("Bearer c") == "Bearer e"
    assert token.upstream_authorization(None) == "Bearer e"
    with pytest.raises(ValueError, match="upstream_token"):
        AuthConfig(upstream="token")


def test_a_caller_is_its_key_when_keys_are_checked_else_its_host() -> None:
    open_ = Credentials(AuthConfig())
    # Anyone may send any Authorization to an open router: the address names the caller.
    assert open_.caller_of({"authorization": "Bearer a"}, "/v1/responses", "10.0.0.1") == (
        "peer:10.0.0.1"
    )
    assert open_.caller_of({}, "/v1/responses", "ipv4:10.0.0.1:5000") == "peer:10.0.0.1"
    assert open_.caller_of({}, "/v1/responses", "ipv6:[::1]:5000") == "peer:::1"
    assert open_.caller_of({}, "/v1/responses", None) == "peer:?"
    keyed = Credentials(AuthConfig(api_keys=["k1", "k2"], accept_x_api_key="all"))
    one = keyed.caller_of({"authorization": "Bearer k1"}, "/v1/responses", "10.0.0.1")
    assert one == keyed.caller_of({"authorization": "Bearer k1"}, "/v1/responses", "10.0.0.2")
    assert one == keyed.caller_of({"x-api-key": "k1"}, "/v1/responses", "10.0.0.3")
    two = keyed.caller_of({"authorization": "Bearer k2"}, "/v1/responses", "10.0.0.1")
    assert one.startswith("key-") and two.startswith("key-") and one != two
    assert "k1" not in one  # a digest, never the key itself


def test_secrets_print_masked() -> None:
    cfg = AuthConfig(api_keys=["sk-visible-not"], upstream="token", upstream_token="tok-123")
    assert "sk-visible-not" not in repr(cfg) and "tok-123" not in cfg.model_dump_json()


def test_a_redis_password_prints_masked_but_reaches_the_client() -> None:
    url = "rediss://kv:pw-Hq71xZ@redis.internal:6380/0?cluster=true"
    shown = "rediss://kv:***@redis.internal:6380/0?cluster=true"
    settings = {"backend": "redis", "redis": {"url": url}}
    config = load_config(overrides={"index": settings}, environ={})
    for text in (repr(config), str(config), repr(config.index), config.model_dump_json()):
        assert "pw-Hq71xZ" not in text and shown in text
    assert config.model_dump(mode="json")["index"]["redis"]["url"] == shown  # config check
    # What needs the real URL keeps it: the attribute (the Redis client) and
    # model_dump(), which reloads rebuild the configuration from.
    assert config.index.redis.url == url
    assert config.model_dump()["index"]["redis"]["url"] == url
    assert Config.model_validate(config.model_dump()).index.redis.url == url
    assert RedisIndex.from_config(config.index.redis).redis.url == url
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redacted("redis://:pw@[::1") == "***"  # unparseable: nothing of it is shown


def test_an_index_url_that_is_not_redis_is_refused_without_its_password() -> None:
    for url, got in (("http://:pw-Hq71xZ@host:1/0", "http://"), ("pw-Hq71xZ@host:1", "no scheme")):
        with pytest.raises(ConfigError, match=r"index\.redis\.url") as refused:
            load_config(overrides={"index": {"redis": {"url": url}}}, environ={})
        assert got in str(refused.value) and "pw-Hq71xZ" not in str(refused.value)
    for scheme in ("redis", "rediss", "unix"):
        load_config(overrides={"index": {"redis": {"url": f"{scheme}://localhost/0"}}}, environ={})


async def test_engine_networks() -> None:
    cidrs = ["127.0.0.0/8", "10.0.0.0/8"]
    assert await engine_allowed("http://127.0.0.1:8000", cidrs) is None
    assert await engine_allowed("http://10.2.3.4:8000", cidrs) is None
    assert "outside" in (await engine_allowed("http://169.254.169.254/", cidrs) or "")
    assert "outside" in (await engine_allowed("http://[::1]:80", cidrs) or "")
    assert await engine_allowed("http://localhost:80", ["127.0.0.0/8", "::1/128"]) is None
    assert "resolve" in (await engine_allowed("http://no-such-host.invalid:80", cidrs) or "")


async def test_event_endpoint_networks() -> None:
    cidrs = ["127.0.0.0/8", "10.0.0.0/8"]
    assert await endpoint_allowed("tcp://10.2.3.4:5557", cidrs) is None
    assert await endpoint_allowed("tcp://[::1]:5557", ["::1/128"]) is None
    assert await endpoint_allowed("ipc:///run/vllm/events", cidrs) is None  # this host
    assert "loopback" in (await endpoint_allowed("ipc:///run/x", ["10.0.0.0/8"]) or "")
    assert "outside" in (await endpoint_allowed("tcp://169.254.169.254:80", cidrs) or "")
    assert "not a tcp" in (await endpoint_allowed("tcp://eth0;10.2.3.4:5557", cidrs) or "")
    assert "not a tcp" in (await endpoint_allowed("pgm://10.2.3.4:5557", cidrs) or "")
    # the engine's own host is allowed whatever the networks say
    assert await endpoint_allowed("tcp://203.0.113.9:5557", cidrs, own_host="203.0.113.9") is None


@pytest.mark.parametrize("path", [".".join(p) for p in OWNED_PATHS])
def test_a_router_owned_field_is_removed_wherever_it_takes_effect(path: str) -> None:
    *outer, name = path.split(".")
    # The same name elsewhere is no engine's to read: it stays.
    payload: dict[str, Any] = {"prompt": "x", "metadata": {"kv_transfer_params": 1}}
    container = payload
    for key in outer:
        container = container.setdefault(key, {"sibling": 1})
    container[name] = {"remote_host": "10.9.9.9"}
    assert owned_fields(payload) == [path]
    assert strip_owned(payload) == [path]
    assert name not in container and owned_fields(payload) == []
    assert payload["prompt"] == "x" and payload["metadata"] == {"kv_transfer_params": 1}
    if outer:
        assert container == {"sibling": 1}


def test_vllms_extra_args_paths_are_router_owned() -> None:
    """Where vLLM 0.32's engine reads kv_transfer_params and ec_transfer_params from
    (``SamplingParams.extra_args``: ``vllm_xargs``, ``sampling_params.extra_args`` on
    /inference/v1/generate)."""
    for field in ("kv_transfer_params", "ec_transfer_params"):
        assert (field,) in OWNED_PATHS
        assert ("vllm_xargs", field) in OWNED_PATHS
        assert ("sampling_params", "extra_args", field) in OWNED_PATHS


def test_containers_of_another_type_are_left_alone() -> None:
    payload: dict[str, Any] = {"vllm_xargs": ["kv_transfer_params"], "sampling_params": "x"}
    assert strip_owned(payload) == []
    assert payload == {"vllm_xargs": ["kv_transfer_params"], "sampling_params": "x"}
