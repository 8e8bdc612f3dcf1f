"""Configuration reload while running (SIGHUP, or a changed ``--config`` file).

A reload builds the configuration again from the same sources (YAML file, environment,
flags), compares it with the running one key by key and applies what can change
without dropping a request: in-flight requests keep the objects they started with, new
ones see the new settings. Everything else is reported as needing a restart and keeps
its running value, so ``app.config`` always says what is in force.

Keys applied live (:data:`LIVE`, by prefix): the routing policy (name and weights), the
disaggregation thresholds and decode weights, the request limits and admission queue
(``limits.*`` but ``max_body_bytes``), the static ``engines`` list (added, removed and changed
engines), health thresholds and timeouts, scrape timeout, proxy timeouts and retries,
and the ``server`` log level, log format, access log, drain timeout and reload poll.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from router.config import Config, ConfigError, EngineConfig, PolicyConfig
from router.engines.registry import endpoint_of
from router.security import redacted

if TYPE_CHECKING:
    from router.app import RouterApp

log = logging.getLogger("kvroute.reload")

#: Configuration keys (dotted prefixes) a reload applies to the running router.
LIVE: tuple[str, ...] = (
    "policy.",
    "disaggregation.",
    "limits.",
    "engines",
    "health.timeout_s",
    "health.eject_after_failures",
    "health.backoff_initial_s",
    "health.backoff_max_s",
    "scrape.timeout_s",
    "proxy.first_byte_timeout_s",
    "proxy.idle_timeout_s",
    "proxy.retries",
    "server.log_level",
    "server.log_format",
    "server.access_log",
    "server.drain_timeout_s",
    "server.reload_poll_s",
    "auth.",
)


#: Keys under a live prefix that still need a restart.
RESTART_ONLY: tuple[str, ...] = ("limits.max_body_bytes",)


def is_live(key: str) -> bool:
    """Whether a reload applies ``key`` (a dotted path) without a restart."""
    if key in RESTART_ONLY:
        return False
    return any(key == p or key.startswith(p) for p in LIVE)


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for name, value in tree.items():
        path = f"{prefix}{name}"
        if isinstance(value, Mapping):
            yield from _flatten(value, f"{path}.")
        else:
            yield path, value  # lists (engines, models) compare as a whole


def changed_keys(old: Config, new: Config) -> dict[str, tuple[Any, Any]]:
    """Every dotted key whose value differs: key -> (old value, new value)."""
    # Python mode: secrets stay SecretStr, which compare by value and print masked.
    before = dict(_flatten(old.model_dump()))
    after = dict(_flatten(new.model_dump()))
    return {
        k: (before.get(k), after.get(k))
        for k in sorted(before.keys() | after.keys())
        if before.get(k) != after.get(k)
    }


def _shown(value: Any) -> Any:
    """A changed value as the reload log shows it: a URL's password masked (``index.url``)."""
    return redacted(value) if isinstance(value, str) else value


def _set(tree: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    for part in parts[:-1]:
        tree = tree.setdefault(part, {})
    tree[parts[-1]] = value


@dataclass(slots=True)
class ReloadResult:
    """What one reload did."""

    applied: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    restart: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    """Keys that changed in the sources but keep their running value until a restart."""


@dataclass(slots=True)
class Reloader:
    """Re-reads the configuration sources and applies the difference to a running router."""

    app: RouterApp
    source: Callable[[], Config]
    """Builds the configuration from its sources (raises ConfigError)."""
    on_logging: Callable[[Config], None] = lambda config: None
    """Called when log settings changed (the process owns the logging setup)."""
    counts: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0})

    async def reload(self) -> ReloadResult | None:
        """Reload now; None (and the running configuration kept) if the new one is invalid."""
        try:
            new = self.source()
            # Key files may have changed under the same paths: read them on every reload.
            self.app.credentials.reload(new.auth)
        except ConfigError as exc:
            self.counts["failed"] += 1
            log.error("configuration reload failed, keeping the running one: %s", exc)
            return None
        result = await self.apply(new)
        self.counts["ok"] += 1
        if result.applied:
            log.info(
                "configuration reloaded: %s",
                "; ".join(
                    f"{k}: {_shown(a)!r} -> {_shown(b)!r}" for k, (a, b) in result.applied.items()
                ),
            )
        else:
            log.info("configuration reloaded: nothing to apply")
        if result.restart:
            log.warning(
                "changed but applied only after a restart: %s",
                "; ".join(
                    f"{k}: {_shown(a)!r} -> {_shown(b)!r}" for k, (a, b) in result.restart.items()
                ),
            )
        return result

    async def apply(self, new: Config) -> ReloadResult:
        """Apply the live part of ``new``; returns what changed and what waits for a restart."""
        app = self.app
        old = app.config
        result = ReloadResult()
        effective = new.model_dump()
        for key, (before, after) in changed_keys(old, new).items():
            if is_live(key):
                result.applied[key] = (before, after)
            else:
                result.restart[key] = (before, after)
                _set(effective, key, before)
        if not result.applied:
            return result
        config = Config.model_validate(effective)
        app.config = config
        self._apply_policy(config, old)
        app.registry.health = config.health
        app.admission.limits = config.limits
        app.core.max_per_engine = config.limits.max_inflight_per_engine
        if app.monitor is not None:
            app.monitor.config = config
        if app.upstream is not None:
            app.upstream.config = config.proxy
            app.upstream.own_authorization = app.credentials.upstream_authorization(None)
        app.observer.access_log_info = config.server.access_log
        if any(k.startswith("server.log") for k in result.applied):
            self.on_logging(config)
        if "engines" in result.applied:
            await self._apply_engines(old.engines, config.engines)
        return result

    def _apply_policy(self, config: Config, old: Config) -> None:
        from router.policy import make_policy

        app = self.app
        if config.policy != old.policy:
            current = app.core.policy
            same = (
                config.policy.name == old.policy.name and config.policy.sglang == old.policy.sglang
            )
            if same and isinstance(getattr(current, "config", None), PolicyConfig):
                current.config = config.policy  # same policy, new weights: its state is kept
            elif not same:
                app.core.policy = make_policy(config.policy)
            app.core.config = config.policy
        if config.policy != old.policy or config.disaggregation != old.disaggregation:
            from router.api.decide import Decider

            app.decider = Decider(app)  # the decode choice from the new weights

    async def _apply_engines(self, old: list[EngineConfig], new: list[EngineConfig]) -> None:
        """Removed and changed engines go (with their index entries), new ones come."""
        app = self.app
        before = {endpoint_of(e.url): e for e in old}
        after = {endpoint_of(e.url): e for e in new}
        for endpoint, cfg in before.items():
            if after.get(endpoint) != cfg:
                await app.remove_engine(endpoint)
                log.info("engine %s removed by reload", cfg.url)
        for endpoint, cfg in after.items():
            if before.get(endpoint) != cfg:
                app.add_engine(cfg)
                log.info("engine %s added by reload", cfg.url)


class ReloadCollector:
    """``kvroute_config_reloads_total{outcome}``, read from a Reloader at scrape time."""

    def __init__(self, reloader: Reloader) -> None:
        self.reloader = reloader

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(
            "kvroute_config_reloads",
            "Configuration reloads (SIGHUP or a changed file) by outcome",
            labels=["outcome"],
        )
        for outcome, n in sorted(self.reloader.counts.items()):
            family.add_metric([outcome], n)
        yield family
