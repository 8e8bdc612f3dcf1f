"""The engines the router knows: identity, role, models, and health state.

An engine is one inference server URL; with ``dp_size`` N it is N routing targets
(:class:`~router.types.EngineKey` per data-parallel rank) that share the URL and
health. Only healthy engines are candidates.

Health: an engine is ``pending`` until its first health probe passes (an engine that
was never reachable is not ready). ``record_failure`` counts consecutive failures from
requests and probes; ``eject_after_failures`` in a row eject the engine for a backoff
that doubles with each ejection in a row (up to ``backoff_max_s``); a successful probe
after the backoff re-admits it and resets the count. A healthy run longer than
``backoff_max_s`` since the last admission starts the doubling over; the count of
ejections (``kvroute_engine_ejections_total``) only grows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from router.config import EngineConfig, EventEndpoints, HealthConfig
from router.metric_catalogue import ENGINE_EJECTIONS, ENGINE_HEALTHY, ENGINE_REFUSED
from router.topology import Topology
from router.types import EngineKey

if TYPE_CHECKING:
    from router.metric_catalogue import StateFamily

log = logging.getLogger("kvroute.engines")


class EngineState(str, Enum):
    PENDING = "pending"
    """Not yet answered a health probe: no requests (it may never have been reachable)."""
    HEALTHY = "healthy"
    EJECTED = "ejected"
    DRAINING = "draining"
    """No new requests; in-flight ones finish (admin drain, shutdown)."""
    REFUSED = "refused"
    """Never routed to: it cannot serve its pool as configured (e.g. another block size)."""


def rank_endpoint(endpoint: str, rank: int) -> str:
    """A DP rank's ZMQ endpoint from rank 0's, by vLLM's rule: a TCP port is offset by the
    rank; an ipc:// or inproc:// path gets ``_dp<rank>``. Rank 0 is unchanged."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if port.isdigit():
            return f"{base}:{int(port) + rank}"
        return endpoint  # a wildcard port: each rank bound its own; ask the engine
    return f"{endpoint}_dp{rank}"


def endpoint_of(url: str) -> str:
    """``http://host:port/...`` -> ``host:port``."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}"


@dataclass(slots=True)
class Engine:
    """One engine and what the router knows about it."""

    url: str
    role: str = "both"
    models: set[str] = field(default_factory=set)
    parents: dict[str, str] = field(default_factory=dict)
    """LoRA adapter -> the base model it extends (from /v1/models ``parent``)."""
    models_configured: bool = False
    """Models come from configuration; discovery does not change them."""
    dp_size: int = 1
    events: EventEndpoints | None = None
    """Where its KV events come from, once known (rank 0's, for DP engines)."""
    rank_events: dict[int, EventEndpoints] = field(default_factory=dict)
    """Per-rank endpoints the engine reported; otherwise derived from ``events``."""
    wants_events: bool = True
    """False when configured with ``kv_events: none``."""
    block_size: int | None = None
    sglang: bool = False
    """An SGLang server (it exports ``sglang:cache_config_info``): a request for one of
    its data-parallel ranks names it in the body's ``data_parallel_rank``."""
    bootstrap_port: int | None = None
    """SGLang prefill engines: where their bootstrap listener is."""
    topology: Topology | None = None
    """Where it runs (node, rack, zone), when known: prices its KV transfers."""
    state: EngineState = EngineState.PENDING
    failures: int = 0
    ejections: int = 0
    """Times ejected since it was registered (only grows: a metric counter)."""
    backoff_level: int = 0
    """Ejections since the last long healthy run: the next backoff's exponent."""
    ejected_until: float = 0.0
    admitted_at: float | None = None
    """When a probe last admitted it (first answer or re-admission); None: never."""
    refused_reason: str = ""
    discovered: bool = False
    """Whether /v1/models and /server_info have been read."""
    endpoint: str = ""
    keys: list[EngineKey] = field(default_factory=list)
    """One routing target per DP rank (kept in step with ``dp_size`` by ``refresh``)."""

    def __post_init__(self) -> None:
        self.endpoint = endpoint_of(self.url)
        self.refresh()

    def refresh(self) -> None:
        """Recompute derived fields after ``dp_size`` changed."""
        self.keys = [EngineKey(self.endpoint, rank) for rank in range(self.dp_size)]

    def events_of(self, rank: int) -> EventEndpoints | None:
        """Where rank ``rank`` publishes its KV events."""
        reported = self.rank_events.get(rank)
        if reported is not None or self.events is None:
            return reported
        base = self.events
        return EventEndpoints(
            endpoint=rank_endpoint(base.endpoint, rank),
            replay_endpoint=rank_endpoint(base.replay_endpoint, rank)
            if base.replay_endpoint
            else None,
            topic=base.topic,
        )

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> Engine:
        return cls(
            url=cfg.url,
            role=cfg.role,
            models=set(cfg.models),
            models_configured=bool(cfg.models),
            dp_size=cfg.dp_size,
            bootstrap_port=cfg.bootstrap_port,
            topology=Topology.from_config(cfg.topology),
            events=cfg.kv_events if isinstance(cfg.kv_events, EventEndpoints) else None,
            wants_events=cfg.kv_events != "none",
        )


_FACTS_KEPT = 4_096


class Registry:
    """All engines, by endpoint, with candidate selection and health bookkeeping."""

    def __init__(self, health: HealthConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.health = health
        self.clock = clock
        self._engines: dict[str, Engine] = {}
        self._candidates: dict[tuple[str, tuple[str, ...]], list[EngineKey]] = {}
        self._models: list[str] | None = None
        self._facts: dict[tuple[str, str], Any] = {}
        """(fact, model) -> ``base_of``'s and ``is_disaggregated``'s answers, asked per
        request and O(engines) each, until :meth:`changed`."""
        self.listeners: list[Callable[[Engine, EngineState], None]] = []
        """Called with (engine, previous state) whenever an engine changes state."""

    def changed(self) -> None:
        """Forget cached candidate lists (call after changing an engine's models, role
        or DP size; state changes and additions call it themselves)."""
        self._candidates.clear()
        self._models = None
        self._facts.clear()

    def __iter__(self) -> Iterable[Engine]:  # type: ignore[override]
        return iter(list(self._engines.values()))

    def __len__(self) -> int:
        return len(self._engines)

    def add(self, engine: Engine) -> Engine:
        self._engines[engine.endpoint] = engine
        self.changed()
        return engine

    def remove(self, endpoint: str) -> Engine | None:
        self.changed()
        return self._engines.pop(endpoint, None)

    def get(self, endpoint: str) -> Engine | None:
        return self._engines.get(endpoint)

    def engine_keys(self) -> list[EngineKey]:
        """Every routing target (one per DP rank), engine by engine."""
        return [key for engine in self._engines.values() for key in engine.keys]

    def engine_of(self, key: EngineKey) -> Engine | None:
        return self._engines.get(key.endpoint)

    def topology_of(self, key: EngineKey) -> Topology | None:
        """Where the engine behind ``key`` runs (None: not known, or no such engine)."""
        engine = self._engines.get(key.endpoint)
        return engine.topology if engine is not None else None

    def models(self) -> list[str]:
        """Every model some engine serves, sorted (a new list: the caller may keep it)."""
        if self._models is None:
            self._models = sorted({m for e in self._engines.values() for m in e.models})
        return list(self._models)

    def _fact(self, fact: str, model: str, work: Callable[[str], Any]) -> Any:
        key = (fact, model)
        try:
            return self._facts[key]
        except KeyError:
            pass
        value = work(model)
        if len(self._facts) >= _FACTS_KEPT:  # models named by requests: bounded
            self._facts.clear()
        self._facts[key] = value
        return value

    def serves(self, model: str) -> bool:
        return any(model in e.models for e in self._engines.values())

    def is_disaggregated(self, model: str) -> bool:
        """Whether the model's engines are split into prefill and decode pools."""
        return bool(self._fact("split", model, self._is_disaggregated))

    def _is_disaggregated(self, model: str) -> bool:
        return any(
            e.role in ("prefill", "decode") and model in e.models for e in self._engines.values()
        )

    def base_of(self, model: str) -> str:
        """The base model of a LoRA adapter (the model itself when it is no adapter)."""
        return str(self._fact("base", model, self._base_of))

    def _base_of(self, model: str) -> str:
        for engine in self._engines.values():
            parent = engine.parents.get(model)
            if parent:
                return parent
        return model

    def base_models(self, engine: Engine) -> list[str]:
        return sorted(m for m in engine.models if m not in engine.parents)

    def candidates(
        self, model: str, roles: tuple[str, ...] = ("both",), exclude: Iterable[str] = ()
    ) -> list[EngineKey]:
        """Routing targets that serve ``model`` in one of ``roles`` and are healthy."""
        skip = set(exclude)
        if not skip:
            cached = self._candidates.get((model, roles))
            if cached is not None:
                return cached
        found = [
            key
            for e in self._engines.values()
            if e.state is EngineState.HEALTHY
            and e.role in roles
            and model in e.models
            and e.endpoint not in skip
            for key in e.keys
        ]
        if not skip:
            self._candidates[(model, roles)] = found
        return found

    def healthy_count(self) -> int:
        return sum(1 for e in self._engines.values() if e.state is EngineState.HEALTHY)

    def metric_families(self) -> Iterator[StateFamily]:
        """Each engine's health, refusal and ejections (its series go with it)."""
        engines = list(self._engines.values())
        yield ENGINE_HEALTHY.labelled(
            ((e.endpoint,), 1.0 if e.state is EngineState.HEALTHY else 0.0) for e in engines
        )
        yield ENGINE_REFUSED.labelled(
            ((e.endpoint,), 1.0 if e.state is EngineState.REFUSED else 0.0) for e in engines
        )
        yield ENGINE_EJECTIONS.labelled(((e.endpoint,), e.ejections) for e in engines)

    # ---------------------------------------------------------------- health

    def _set_state(self, engine: Engine, state: EngineState) -> None:
        previous = engine.state
        if previous is state:
            return
        engine.state = state
        self.changed()
        for listener in self.listeners:
            listener(engine, previous)

    def record_success(self, engine: Engine) -> None:
        engine.failures = 0

    def record_failure(self, engine: Engine) -> bool:
        """Count a failure; returns True if this one ejected the engine."""
        engine.failures += 1
        if (
            engine.state is not EngineState.HEALTHY
            or engine.failures < self.health.eject_after_failures
        ):
            return False
        now = self.clock()
        if engine.admitted_at is not None and now - engine.admitted_at > self.health.backoff_max_s:
            engine.backoff_level = 0  # a long healthy run forgives earlier ejections
        backoff = min(
            self.health.backoff_initial_s * 2**engine.backoff_level, self.health.backoff_max_s
        )
        if backoff < self.health.backoff_max_s:
            engine.backoff_level += 1
        engine.ejections += 1
        engine.ejected_until = now + backoff
        log.warning(
            "engine %s ejected after %d failures in a row (requests or probes); "
            "re-admitted by a passing probe after %.1f s (ejection %d)",
            engine.url,
            engine.failures,
            backoff,
            engine.ejections,
        )
        self._set_state(engine, EngineState.EJECTED)
        return True

    def probe_succeeded(self, engine: Engine) -> bool:
        """A health probe passed; returns True if that admitted the engine (its first
        answer, or a re-admission after an ejection)."""
        engine.failures = 0
        now = self.clock()
        if engine.state is EngineState.PENDING or (
            engine.state is EngineState.EJECTED and now >= engine.ejected_until
        ):
            log.info(
                "engine %s %s",
                engine.url,
                "re-admitted" if engine.state is EngineState.EJECTED else "answers: healthy",
            )
            engine.admitted_at = now
            self._set_state(engine, EngineState.HEALTHY)
            return True
        return False

    def refuse(self, engine: Engine, reason: str) -> None:
        """Stop routing to an engine that cannot serve its pool as configured."""
        engine.refused_reason = reason
        self._set_state(engine, EngineState.REFUSED)

    def drain(self, engine: Engine) -> None:
        self._set_state(engine, EngineState.DRAINING)

    def undrain(self, engine: Engine) -> None:
        """Back to taking requests (to ``pending`` if no probe has passed yet)."""
        if engine.state is EngineState.DRAINING:
            admitted = engine.admitted_at is not None
            self._set_state(engine, EngineState.HEALTHY if admitted else EngineState.PENDING)
