"""Configuration reload while running (SIGHUP, or a changed ``--config`` file).

A reload builds the configuration again from the same sources (YAML file, environment,
flags), compares it with the running one key by key and publishes what can change
without dropping a request to the :class:`~router.live_config.LiveConfig`, whose
subscribers (the routing core, the registry, the proxy, ...) apply their sections
themselves: in-flight requests keep the objects they started with, new ones see the new
settings. Everything else is reported as needing a restart and keeps its running value,
so ``app.config`` always says what is in force.

Keys applied live (:data:`LIVE`, by prefix): the routing policy (name and weights), the
disaggregation thresholds and decode weights, the request limits and admission queue
(``limits.*`` but ``max_body_bytes``), the static ``engines`` list (added, removed and changed
engines), health thresholds and timeouts, scrape timeout, proxy timeouts and retries,
and the ``server`` log level, log format, access log, drain timeout and reload poll,
and ``auth.*`` (key files are read again on every reload).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from router.config import Config, ConfigError
from router.metric_catalogue import CONFIG_RELOADS
from router.redaction import redacted

if TYPE_CHECKING:
    from router.live_config import LiveConfig
    from router.metric_catalogue import StateFamily
    from router.security import Credentials

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
    """Re-reads the configuration sources and publishes the live difference."""

    live: LiveConfig
    """The running configuration; its subscribers apply what a reload changes."""
    source: Callable[[], Config]
    """Builds the configuration from its sources (raises ConfigError)."""
    credentials: Credentials
    """The keys in force: their files are read again on every reload."""
    counts: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0})

    async def reload(self) -> ReloadResult | None:
        """Reload now; None (and the running configuration kept) if the new one is invalid."""
        try:
            new = self.source()
            # Key files may have changed under the same paths: read them on every reload.
            self.credentials.reload(new.auth)
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
        """Publish the live part of ``new``; returns what changed and what waits for a
        restart (those keys keep their running values in what is published)."""
        result = ReloadResult()
        effective = new.model_dump()
        for key, (before, after) in changed_keys(self.live.current, new).items():
            if is_live(key):
                result.applied[key] = (before, after)
            else:
                result.restart[key] = (before, after)
                _set(effective, key, before)
        if result.applied:
            await self.live.publish(Config.model_validate(effective))
        return result


class ReloadCollector:
    """``kvroute_config_reloads_total{outcome}``, read from a Reloader at scrape time."""

    def __init__(self, reloader: Reloader) -> None:
        self.reloader = reloader

    def collect(self) -> Iterator[StateFamily]:
        counts = sorted(self.reloader.counts.items())
        yield CONFIG_RELOADS.labelled(((outcome,), n) for outcome, n in counts)
