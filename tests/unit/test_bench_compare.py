"""``make bench-compare``'s targets and commands, built without running anything."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pytest

from router.bench import compare
from router.bench.cli import add_arguments
from router.bench.targets import command_argv, parse_target
from router.emulator import cli as engine_cli
from router.emulator.config import DEFAULT_MODEL
from router.engine_model.params import EngineParams

ENGINES = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
LISTS = {
    "kv_event_sources": [f"{u}=tcp://127.0.0.1:{5000 + i}" for i, u in enumerate(ENGINES)],
    "kv_event_replay_sources": [f"{u}=tcp://127.0.0.1:{6000 + i}" for i, u in enumerate(ENGINES)],
}


def installed(build: Path, name: str) -> tuple[Path | None, str]:
    return build / name / "bin" / name, f"{name}==test"


def not_installed(build: Path, name: str) -> tuple[Path | None, str]:
    return None, f"cannot install {name}==test: no network"


def argv_of(spec: str) -> list[str]:
    target = parse_target(spec)
    assert target.kind == "cmd"
    return command_argv(target.value, ENGINES, "127.0.0.1", 4321, LISTS)


def flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv) if word == flag]


def after(argv: list[str], flag: str, count: int) -> list[str]:
    i = argv.index(flag)
    return argv[i + 1 : i + 1 + count]


def test_the_seven_targets_their_policies_and_kv_event_sources(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(compare, "install", installed)
    specs = compare.targets()
    targets = {t.name: t for t in map(parse_target, specs)}
    assert list(targets) == [
        "kvroute",
        "kv_cost",
        "rr",
        "sglang_ca",
        "sglang",
        "vllm_ca",
        "vllm_kv",
    ]
    assert {n: (t.kind, t.value) for n, t in targets.items() if t.kind == "policy"} == {
        "kvroute": ("policy", "latency"),  # the default
        "kv_cost": ("policy", "kv_cost"),
        "rr": ("policy", "round_robin"),
        "sglang_ca": ("policy", "cache_aware_sglang"),
    }

    sglang = argv_of(specs[4])
    assert sglang[:2] == [str(compare.BUILD / "sglang-router/bin/sglang-router"), "launch"]
    assert flag_values(sglang, "--policy") == ["cache_aware"]
    assert after(sglang, "--worker-urls", 2) == ENGINES
    assert flag_values(sglang, "--host") == ["127.0.0.1"]
    assert flag_values(sglang, "--port") == ["4321"]
    assert "--kv-event-source" not in sglang

    vllm = str(compare.BUILD / "vllm-router/bin/vllm-router")
    cache_aware = argv_of(specs[5])
    assert cache_aware[0] == vllm
    assert flag_values(cache_aware, "--policy") == ["cache_aware"]
    assert after(cache_aware, "--worker-urls", 2) == ENGINES
    assert "--kv-event-source" not in cache_aware

    kv_aware = argv_of(specs[6])
    assert kv_aware[0] == vllm
    assert flag_values(kv_aware, "--policy") == ["kv_aware"]
    assert after(kv_aware, "--worker-urls", 2) == ENGINES
    # One --kv-event-source URL=ENDPOINT (and replay source) per engine, as vllm-router
    # takes them, with the engines' block size and served model.
    assert flag_values(kv_aware, "--kv-event-source") == LISTS["kv_event_sources"]
    assert flag_values(kv_aware, "--kv-event-replay-source") == LISTS["kv_event_replay_sources"]
    assert flag_values(kv_aware, "--kv-event-block-size") == [str(EngineParams().block_size)]
    assert flag_values(kv_aware, "--kv-event-model") == [DEFAULT_MODEL]
    for argv in (sglang, cache_aware, kv_aware):
        (metrics_port,) = flag_values(argv, "--prometheus-port")
        assert metrics_port.isdigit() and metrics_port != "4321"
        assert flag_values(argv, "--prometheus-host") == ["127.0.0.1"]


def test_a_peer_that_cannot_be_installed_is_left_out_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(compare, "install", not_installed)
    assert [parse_target(s).name for s in compare.targets()] == [
        "kvroute",
        "kv_cost",
        "rr",
        "sglang_ca",
    ]
    err = capsys.readouterr().err
    assert "no sglang-router (cannot install sglang-router==test: no network)" in err
    assert "no vllm-router (cannot install vllm-router==test: no network)" in err


def test_both_runs_are_valid_bench_commands_on_kv_event_publishing_engines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(compare, "install", installed)
    runs = compare.bench_argvs(compare.targets())
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    mooncake, chat = (parser.parse_args(argv) for argv in runs)
    for args in (mooncake, chat):
        assert args.engines == 4
        assert args.baseline == "rr"
        assert args.model == DEFAULT_MODEL
        assert len(args.compare) == 7
        # TCP KV events, so that vllm-router (another process) can subscribe to them.
        assert "--kv-events-endpoint tcp://127.0.0.1:*" in args.engine_args
    assert (mooncake.workload, mooncake.requests, mooncake.speedup) == (
        "mooncake-conversation",
        1500,
        8,
    )
    assert (chat.workload, chat.conversations, chat.turns, chat.concurrency) == ("chat", 64, 6, 16)
    assert mooncake.output != chat.output


def test_engines_publish_kv_events_vllm_router_can_read() -> None:
    # vllm-router 0.1.17's static sources drop every message whose topic is not "" (vLLM's
    # default) and decode only an array batch of tagged-map events (v2-mixed).
    parser = argparse.ArgumentParser()
    engine_cli.add_arguments(parser)
    config = engine_cli.config_from_args(parser.parse_args(shlex.split(compare.ENGINE_ARGS)))
    assert config.kv_events_endpoint == "tcp://127.0.0.1:*"
    assert config.kv_events_topic == ""
    assert config.kv_events_format == "v2-mixed"
