"""Engine health bookkeeping: admission, ejection, the doubling backoff, the counter."""

from __future__ import annotations

import logging

import pytest

from router.config import HealthConfig
from router.fleet.registry import Engine, EngineState, Registry


class Clock:
    def __init__(self) -> None:
        self.now = 10_000.0  # a monotonic clock is far from 0 on a running machine

    def __call__(self) -> float:
        return self.now


HEALTH = HealthConfig(eject_after_failures=3, backoff_initial_s=1.0, backoff_max_s=30.0)


def fleet() -> tuple[Registry, Engine, Clock]:
    clock = Clock()
    registry = Registry(HEALTH, clock=clock)
    engine = registry.add(Engine("http://127.0.0.1:9", models={"m"}))
    return registry, engine, clock


def eject(registry: Registry, engine: Engine) -> float:
    """Fail the engine until it is ejected; returns its backoff."""
    while not registry.record_failure(engine):
        pass
    return engine.ejected_until - registry.clock()


def readmit(registry: Registry, engine: Engine, clock: Clock) -> None:
    clock.now = engine.ejected_until
    assert registry.probe_succeeded(engine)
    assert engine.state is EngineState.HEALTHY


def test_an_engine_is_pending_until_its_first_probe_passes() -> None:
    registry, engine, _ = fleet()
    assert engine.state is EngineState.PENDING
    assert registry.candidates("m") == [] and registry.healthy_count() == 0
    for _ in range(10):  # never reachable: not ejected either, just not ready
        assert not registry.record_failure(engine)
    assert engine.state is EngineState.PENDING and engine.ejections == 0
    assert registry.probe_succeeded(engine)
    assert registry.candidates("m") == engine.keys and registry.healthy_count() == 1


def test_undraining_an_engine_never_probed_leaves_it_pending() -> None:
    registry, engine, _ = fleet()
    registry.drain(engine)
    registry.undrain(engine)
    assert engine.state is EngineState.PENDING


def test_the_backoff_doubles_with_each_ejection_in_a_row_up_to_the_maximum() -> None:
    registry, engine, clock = fleet()
    registry.probe_succeeded(engine)
    backoffs = []
    for _ in range(7):
        clock.now += 5.0  # each healthy run is short
        backoffs.append(eject(registry, engine))
        clock.now += 40.0  # ejected for long: still failing its probes
        for _ in range(5):
            registry.record_failure(engine)
        readmit(registry, engine, clock)
    assert backoffs == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_the_ejection_count_never_goes_down() -> None:
    registry, engine, clock = fleet()
    registry.probe_succeeded(engine)
    seen = []
    for _ in range(4):
        clock.now += 100.0  # long healthy runs forgive the backoff, not the count
        assert eject(registry, engine) == 1.0
        seen.append(engine.ejections)
        clock.now += 100.0
        registry.record_failure(engine)
        seen.append(engine.ejections)
        readmit(registry, engine, clock)
    assert seen == [1, 1, 2, 2, 3, 3, 4, 4]


def test_a_long_healthy_run_starts_the_backoff_over() -> None:
    registry, engine, clock = fleet()
    registry.probe_succeeded(engine)
    assert eject(registry, engine) == 1.0
    readmit(registry, engine, clock)
    clock.now += 5.0
    assert eject(registry, engine) == 2.0
    readmit(registry, engine, clock)
    clock.now += HEALTH.backoff_max_s + 1
    assert eject(registry, engine) == 1.0


def test_an_ejection_is_logged_whoever_counted_the_failures(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry, engine, _ = fleet()
    registry.probe_succeeded(engine)
    with caplog.at_level(logging.WARNING, "kvroute.engines"):
        eject(registry, engine)
    assert "engine http://127.0.0.1:9 ejected after 3 failures" in caplog.text
    assert "after 1.0 s" in caplog.text


def test_model_facts_are_remembered_until_the_fleet_changes() -> None:
    """models(), base_of() and is_disaggregated() are asked per request and cost
    O(engines): they are kept until an engine is added, removed or changed."""
    registry = Registry(HealthConfig())
    registry.add(Engine("http://127.0.0.1:9", models={"m", "lora"}, parents={"lora": "m"}))
    first = registry.models()
    assert first == ["lora", "m"]
    first.append("mine")  # the caller's copy
    assert registry.models() == ["lora", "m"]
    assert registry.base_of("lora") == "m" and registry.base_of("other") == "other"
    assert not registry.is_disaggregated("m")
    registry.add(Engine("http://127.0.0.1:10", models={"m2"}, role="prefill"))
    assert registry.models() == ["lora", "m", "m2"]
    assert registry.is_disaggregated("m2")
    engine = registry.get("127.0.0.1:9")
    assert engine is not None
    engine.models, engine.parents = {"m", "lora2"}, {"lora2": "m"}  # as the monitor does
    registry.changed()
    assert registry.models() == ["lora2", "m", "m2"]
    assert registry.base_of("lora") == "lora" and registry.base_of("lora2") == "m"
    registry.remove("127.0.0.1:10")
    assert registry.models() == ["lora2", "m"] and not registry.is_disaggregated("m2")
