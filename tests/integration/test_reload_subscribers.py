"""Every key a reload reports applied changes what the running router reads.

For each section that has reloadable keys, the test walks every key of the section's
model, reloads a running router (real engine, real ``Reloader``) with that one key
changed, and checks the value the component using it reads: its own copy where it
keeps one (the policy object, the registry's health settings, the proxy's timeouts),
the live configuration (``app.config``) where the value is read per use. A key that is
live but has no entry in :data:`READS` fails: give it a subscriber that applies it and
say here where it is read, or list it in ``router.reload.RESTART_ONLY``. Keys that need
a restart must be reported so and keep their running value.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError
from support.engines import start_test_engine
from support.routers import start_router

from router import logs
from router.app import RouterApp
from router.config import Config
from router.emulator import EmulatedEngine
from router.reload import LIVE, Reloader, is_live
from router.serve import follow_logging
from router.topology import LOCALITIES

Reader = Callable[[RouterApp], Any]


def _reads(section: str, view: Reader, names: str) -> dict[str, Reader]:
    """``section.name`` for each of ``names``, read as ``view(app).name``."""
    return {f"{section}.{n}": (lambda app, n=n: getattr(view(app), n)) for n in names.split()}


def _kv_cost(app: RouterApp) -> Any:
    return app.core.policy.config  # KVCostPolicy reads its weights per decision


def _decode(app: RouterApp) -> Any:
    return app.decider.decode_policy.config  # built from policy + disaggregation


def _planner(app: RouterApp) -> Any:
    return app.decider.planner.disaggregation  # rebuilt when the section changes


def _monitor(app: RouterApp) -> Any:
    assert app.monitor is not None
    return app.monitor.config  # probes and scrapes read it per call


def _upstream(app: RouterApp) -> Any:
    assert app.upstream is not None
    return app.upstream


def _live(section: str) -> Reader:
    return lambda app: getattr(app.config, section)


#: Where the running router reads each reloadable key.
READS: dict[str, Reader] = {
    "policy.name": lambda app: app.core.policy.name,
    **_reads(
        "policy",
        _kv_cost,
        "prefill_weight queue_weight decode_weight waiting_weight kv_usage_weight "
        "running_weight report_max_age_s offload_weight disk_weight temperature",
    ),
    **_reads("policy", lambda app: app.core.config, "provisional_ttl_s approximate_ttl_s"),
    # Under cache_aware_sglang (see BASES): the core builds a new policy from them.
    **_reads(
        "policy.sglang",
        lambda app: app.core.policy.config,
        "cache_threshold balance_abs_threshold balance_rel_threshold max_tree_size "
        "eviction_interval_s",
    ),
    # Under the latency policy (see BASES): it reads its section per decision, and the
    # load tracker's latency model takes the priors (keeping what it learnt).
    **_reads(
        "policy.latency",
        lambda app: app.core.policy.config.latency,
        "itl_weight idle_prefill_weight slowdown_weight tie_tolerance harm_counts queue_model "
        "speed_tolerance slo session_bonus_ms session_max_wait_ms session_ttl_s max_sessions",
    ),
    **{
        f"policy.latency.{key}": (lambda app, prior=prior: getattr(app.loads.latency.priors, prior))
        for key, prior in (
            ("prefill_us_per_token", "prefill_s_per_token"),
            ("ttft_overhead_ms", "ttft_overhead_s"),
            ("tpot_base_ms", "tpot_base_s"),
            ("tpot_us_per_seq", "tpot_s_per_seq"),
            ("prior_weight", "prior_weight"),
            ("half_life_s", "half_life_s"),
        )
    },
    "policy.session_header": lambda app: app.config.policy.session_header,  # per request
    # The split decision and the handoff read these per request.
    **_reads(
        "disaggregation",
        _live("disaggregation"),
        "handoff min_uncached_tokens decode_hit_ratio kv_bytes_per_token "
        "transfer_bandwidth_gb_s prefill_s_per_token handoff_overhead_s fallback_to_decode "
        "rewrite_loopback_host",
    ),
    # The planner the decider rebuilds on a change prices links and applies the floors.
    **_reads("disaggregation", _planner, "min_link_bandwidth_gb_s min_prefill_engines"),
    **{
        f"disaggregation.links.{kind}.{name}": (
            lambda app, kind=kind, name=name: getattr(getattr(_planner(app).links, kind), name)
        )
        for kind in LOCALITIES
        for name in ("bandwidth_gb_s", "latency_s", "min_uncached_tokens")
    },
    "disaggregation.decode_weight": lambda app: _decode(app).decode_weight,
    "disaggregation.decode_queue_weight": lambda app: _decode(app).queue_weight,
    "disaggregation.decode_prefix_weight": lambda app: _decode(app).prefill_weight,
    "disaggregation.decode_kv_usage_weight": lambda app: _decode(app).kv_usage_weight,
    "disaggregation.decode_waiting_weight": lambda app: _decode(app).waiting_weight,
    "disaggregation.decode_running_weight": lambda app: _decode(app).running_weight,
    # Request validation reads these per request (HTTP, gRPC, ext_proc).
    **_reads(
        "limits",
        _live("limits"),
        "max_json_depth max_prompt_tokens max_output_tokens max_n max_prompts "
        "max_sequences default_max_tokens",
    ),
    **_reads(
        "limits",
        lambda app: app.admission.limits,
        "max_inflight admission_queue admission_timeout_s",
    ),
    "limits.max_inflight_per_engine": lambda app: app.core.max_per_engine,
    "limits.max_dp_size": lambda app: _monitor(app).limits.max_dp_size,
    "engines": lambda app: sorted(e.endpoint for e in app.registry),
    "health.timeout_s": lambda app: _monitor(app).health.timeout_s,
    **_reads(
        "health",
        lambda app: app.registry.health,
        "eject_after_failures backoff_initial_s backoff_max_s",
    ),
    "scrape.timeout_s": lambda app: _monitor(app).scrape.timeout_s,
    "proxy.first_byte_timeout_s": lambda app: _upstream(app).config.first_byte_timeout_s,
    **_reads("proxy", _live("proxy"), "idle_timeout_s retries"),  # per request (serving/forward.py)
    "server.log_level": lambda app: CONFIGURED_LOGGING[-1][0],
    "server.log_format": lambda app: CONFIGURED_LOGGING[-1][1],
    "server.access_log": lambda app: app.observer.access_log_info,
    **_reads("server", _live("server"), "drain_timeout_s reload_poll_s"),  # read by serve.py
    "auth.api_keys": lambda app: app.credentials.client,
    "auth.api_keys_file": lambda app: app.credentials.client,
    "auth.admin_keys": lambda app: app.credentials.admin,
    "auth.admin_keys_file": lambda app: app.credentials.admin,
    "auth.metrics_need_key": lambda app: app.credentials.metrics_need_key,
    "auth.accept_x_api_key": lambda app: app.credentials.x_api_key,
    "auth.upstream": lambda app: app.credentials.upstream_mode,
    "auth.upstream_token": lambda app: _upstream(app).own_authorization,
    "auth.upstream_token_file": lambda app: _upstream(app).own_authorization,
    "auth.engine_cidrs": lambda app: _monitor(app).auth.engine_cidrs,
    "auth.allow_client_handoff_fields": lambda app: app.config.auth.allow_client_handoff_fields,
}

#: Where ``kvroute serve``'s logging subscriber would have set logging up: (level, format).
CONFIGURED_LOGGING: list[tuple[str, str]] = []


def _sections() -> set[str]:
    return {prefix.split(".")[0] for prefix in LIVE}


def _keys(model: type[BaseModel], prefix: str) -> Iterator[str]:
    """Every dotted key below ``model``, as reload compares them (lists whole)."""
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _keys(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def _annotation(key: str) -> Any:
    model: Any = Config
    *parents, last = key.split(".")
    for part in parents:
        model = model.model_fields[part].annotation
    return model.model_fields[last].annotation


def _get(tree: Mapping[str, Any], key: str) -> Any:
    for part in key.split("."):
        tree = tree[part]
    return tree


def _set(tree: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        tree = tree[part]
    tree[last] = value


def _candidates(key: str, value: Any) -> list[Any]:
    """New values to try for ``key`` (the first that validates is used)."""
    args = typing.get_args(_annotation(key))
    if typing.get_origin(_annotation(key)) is typing.Literal:
        return [a for a in args if a != value]
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value - 1]
    if isinstance(value, float):
        return [value * 2 if value else 0.5, value / 2]
    if value is None and float in args:
        return [0.5]
    return []


def _changed(base: Config, key: str, special: Mapping[str, Any]) -> Config | None:
    tree = base.model_dump()
    value = _get(tree, key)
    for candidate in [special[key]] if key in special else _candidates(key, value):
        _set(tree, key, candidate)
        try:
            return Config.model_validate(tree)
        except ValidationError:
            continue
    return None


def _with(config: Config, sections: Mapping[str, Mapping[str, Any]]) -> Config:
    tree = config.model_dump()
    for name, values in sections.items():
        tree[name].update(values)
    return Config.model_validate(tree)


@pytest.fixture
def configured_logging(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Record what the logging subscriber sets up instead of changing the process's."""
    CONFIGURED_LOGGING[:] = [("info", "text")]
    monkeypatch.setattr(
        logs, "configure_logging", lambda level, fmt: CONFIGURED_LOGGING.append((level, fmt))
    )
    return CONFIGURED_LOGGING


async def test_every_reloadable_key_reaches_what_reads_it(
    engine: EmulatedEngine, tmp_path: Path, configured_logging: list[tuple[str, str]]
) -> None:
    def keys_file(name: str, key: str) -> str:
        path = tmp_path / name
        path.write_text(f"{key}\n")
        return str(path)

    other = await start_test_engine(engine_id="reload-keys-other")
    #: A base where the key matters (the sglang rule's settings under its policy...).
    bases: dict[str, dict[str, dict[str, Any]]] = {
        "policy.sglang.": {"policy": {"name": "cache_aware_sglang"}},
        "policy.latency.": {"policy": {"name": "latency"}},
        "auth.upstream_token": {"auth": {"upstream": "token", "upstream_token": "first"}},
        "auth.upstream_token_file": {
            "auth": {"upstream": "token", "upstream_token_file": keys_file("t1", "first")}
        },
    }
    special: dict[str, Any] = {
        "policy.name": "round_robin",
        "policy.latency.slo": {"*": {"ttft_ms": 500.0}},
        "policy.session_header": "x-conversation",
        "disaggregation.handoff": "sglang",  # a name the handoff registry knows
        **{f"disaggregation.links.{kind}.min_uncached_tokens": 256 for kind in LOCALITIES},
        "engines": [{"url": other.url}],
        "auth.api_keys": ["client-key"],
        "auth.admin_keys": ["admin-key"],
        "auth.api_keys_file": keys_file("clients", "client-key"),
        "auth.admin_keys_file": keys_file("admins", "admin-key"),
        "auth.upstream_token": "second",
        "auth.upstream_token_file": keys_file("t2", "second"),
        "auth.engine_cidrs": ["127.0.0.0/8"],
    }
    app = await start_router([engine.url], policy={"name": "kv_cost"})
    follow_logging(app.live)
    source: list[Config] = [app.config]
    reloader = Reloader(app.live, lambda: source[0], app.credentials)

    async def reload_to(config: Config) -> Any:
        source[0] = config
        result = await reloader.reload()
        assert result is not None
        return result

    main = app.config
    unread, unchanged = [], []
    try:
        for section in sorted(_sections()):
            for key in _section_keys(section):
                base = main
                for prefix, sections in bases.items():
                    if key == prefix or key.startswith(prefix):
                        base = _with(main, sections)
                await reload_to(base)
                new = _changed(base, key, special)
                if not is_live(key):
                    if new is None:  # e.g. a file path: listed as needing a restart is enough
                        continue
                    result = await reload_to(new)
                    assert key in result.restart and key not in result.applied
                    assert _get(app.config.model_dump(), key) == _get(base.model_dump(), key)
                    continue
                if key not in READS:
                    unread.append(key)
                    continue
                assert new is not None, f"{key}: no changed value to try; add one to `special`"
                before = READS[key](app)
                result = await reload_to(new)
                # A dict-valued key (policy.latency.slo) is reported by the paths inside it.
                assert key in result.applied or any(
                    applied.startswith(f"{key}.") for applied in result.applied
                ), key
                if READS[key](app) == before:
                    unchanged.append(key)
        await reload_to(main)
    finally:
        await app.stop()
        await other.stop()
    assert unread == [], (
        f"reloadable keys with no known reader: {unread}; subscribe the component that "
        "uses each (router/reconfigure.py, follow_config) and add it to READS, or list it in "
        "router.reload.RESTART_ONLY"
    )
    assert unchanged == [], f"reloaded, but what the router reads did not change: {unchanged}"


def _section_keys(section: str) -> list[str]:
    annotation = Config.model_fields[section].annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return list(_keys(annotation, f"{section}."))
    return [section]  # a list section (engines) compares whole


def test_every_reader_names_a_reloadable_key() -> None:
    keys = {k for s in _sections() for k in _section_keys(s)}
    assert set(READS) <= keys and all(is_live(k) for k in READS)
