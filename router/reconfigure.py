"""Who applies which section of a reloaded configuration, in the order they are called.

:mod:`router.reload` publishes a new configuration to the
:class:`~router.live_config.LiveConfig`; each subscriber below applies the sections its
component keeps something from. Code that reads a value where it uses it (request limits,
retries, the split thresholds) reads the live configuration and needs no subscription. A
new component that keeps something from a live section subscribes here, and its reader
goes into ``READS`` in tests/integration/test_reload_subscribers.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from router.config import Config
    from router.fleet.membership import EngineFleet
    from router.serving.services import Services
    from router.session_sharing import SessionSharing


class AccessLog(Protocol):
    """What logs each request (the HTTP front end's request observer)."""

    access_log_info: bool
    """Access log at info level (``server.access_log``); else at debug level."""


def follow_config(
    services: Services, sessions: SessionSharing, observer: AccessLog, fleet: EngineFleet
) -> None:
    """Subscribe every component that keeps something from a live section: those the
    front ends share (``services``), the replicas' session sharing, the HTTP request
    observer and the fleet (its engine monitor and static engines). The upstream client
    and the engine monitor exist once the router has started; before, they are built
    from the configuration current then."""
    core, credentials = services.core, services.credentials

    def routing_core(new: Config, old: Config) -> None:
        core.reconfigure(new.policy, new.limits.max_inflight_per_engine)

    def decider(new: Config, old: Config) -> None:
        services.decider.reconfigure()  # the decode choice from the new weights

    def health(new: Config, old: Config) -> None:
        services.registry.health = new.health

    def limits(new: Config, old: Config) -> None:
        services.admission.limits = new.limits

    def access_log(new: Config, old: Config) -> None:
        observer.access_log_info = new.server.access_log

    def upstream(new: Config, old: Config) -> None:
        if services.upstream is not None:
            services.upstream.reconfigure(new.proxy, credentials.upstream_authorization(None))

    def monitor(new: Config, old: Config) -> None:
        if fleet.monitor is not None:
            fleet.monitor.config = new

    live = services.live
    live.subscribe("routing core", ("policy", "limits"), routing_core)
    live.subscribe("decider", ("policy", "disaggregation"), decider)
    live.subscribe("session sharing", ("policy",), sessions.share)
    live.subscribe("registry", ("health",), health)
    live.subscribe("admission", ("limits",), limits)
    live.subscribe("request observer", ("server",), access_log)
    live.subscribe("upstream", ("proxy", "auth"), upstream)
    live.subscribe("engine monitor", ("health", "scrape", "auth", "limits"), monitor)
    live.subscribe("engines", ("engines",), fleet.apply_engines)
