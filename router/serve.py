"""``kvroute serve``: the router.

Stable quick-start flags (outside checks use them): ``--host``, ``--port`` (0 picks a
free port; the bound address is printed), ``--engine URL`` (repeatable), ``--policy``,
``--config FILE`` (YAML), ``--log-level``, ``--grpc-port`` and ``--extproc-port`` (the
gRPC API and the Envoy ext_proc endpoint picker; their bound addresses are printed too).
Flags override the YAML file and ``KVROUTE_*`` environment variables. One asyncio
process (uvloop); scale out with replicas sharing a Redis index, never with workers.

Signals: SIGTERM (and SIGINT) drain: the router reports not ready, stops accepting
connections, lets in-flight requests and streams finish for up to
``server.drain_timeout_s``, cancels what is left and exits 0. SIGHUP reloads the
configuration from the same file, environment and flags (:mod:`router.reload`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

from router.config import Config, ConfigError, load_config
from router.frontends.http.listener import ListenError
from router.handoff import registry as handoff_registry
from router.live_config import LiveConfig
from router.policy import DEFAULT_POLICY, POLICY_NAMES

log = logging.getLogger("kvroute")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML configuration file")
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to bind; 0 picks a free one (default 8000)")
    parser.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="URL",
        help="an engine serving prefill and decode (repeatable): its server's root URL, "
        "e.g. http://10.0.0.5:8000 (no /v1 or other path)",
    )
    parser.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help="a prefill engine of a disaggregated pool (repeatable)",
    )
    parser.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL",
        help="a decode engine of a disaggregated pool (repeatable)",
    )
    parser.add_argument(
        "--handoff",
        choices=handoff_registry.names(),
        help="KV-transfer dialect between prefill and decode engines (default nixl)",
    )
    parser.add_argument(
        "--policy",
        choices=[*POLICY_NAMES, "default"],
        help=f"routing policy; 'default' (also what an unset one means) is {DEFAULT_POLICY}: "
        "cache and load priced in seconds of the engines' own measured speed (kv_cost: the "
        "previous default)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        help="tokens per KV block; must match the engines (default: each model's pool takes "
        "the block size its first engine reports, 16 until one does)",
    )
    parser.add_argument(
        "--kv-events-port",
        type=int,
        metavar="N",
        help="engines that report no KV-event endpoints publish at tcp://<engine host>:N "
        "(events.port; llm-d's convention is 5557)",
    )
    parser.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], help="log verbosity"
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="log lines as text (default) or one JSON object per line",
    )
    parser.add_argument(
        "--grpc-port",
        type=int,
        metavar="N",
        help="also serve the gRPC API (kvroute.v1) on this port; 0 picks a free one",
    )
    parser.add_argument(
        "--extproc-port",
        type=int,
        metavar="N",
        help="also serve the Envoy ext_proc endpoint picker on this port; 0 picks a free one",
    )


def config_from_args(args: argparse.Namespace) -> Config:
    overrides: dict[str, Any] = {}
    server = {
        k: v
        for k, v in (
            ("host", args.host),
            ("port", args.port),
            ("log_level", args.log_level),
            ("log_format", args.log_format),
        )
        if v is not None
    }
    if server:
        overrides["server"] = server
    if args.policy:
        overrides["policy"] = {"name": args.policy}
    if args.block_size is not None:
        overrides["block_size"] = args.block_size
    if args.handoff:
        overrides["disaggregation"] = {"handoff": args.handoff}
    if args.kv_events_port is not None:
        overrides["events"] = {"port": args.kv_events_port}
    if args.grpc_port is not None:
        overrides["grpc"] = {"port": args.grpc_port}
    if args.extproc_port is not None:
        overrides["extproc"] = {"port": args.extproc_port}
    config = load_config(args.config, overrides)
    added = [
        *({"url": url, "role": "both"} for url in args.engine),
        *({"url": url, "role": "prefill"} for url in args.prefill),
        *({"url": url, "role": "decode"} for url in args.decode),
    ]
    if added:
        engines = [*config.model_dump()["engines"], *added]
        config = load_config(args.config, {**overrides, "engines": engines})
    return config


async def serve(
    config: Config,
    source: Callable[[], Config] | None = None,
    config_path: str | None = None,
) -> int:
    """Run until SIGTERM or SIGINT, then drain and exit; SIGHUP reloads from ``source``."""
    from router.app import RouterApp
    from router.reload import ReloadCollector, Reloader

    app = RouterApp(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    follow_logging(app.live)
    reloader = Reloader(app.live, source or (lambda: app.config), app.credentials)
    app.reloader = reloader  # POST /admin/reload and gRPC Admin/Reload
    app.metrics.registry.register(ReloadCollector(reloader))
    reloads: set[asyncio.Task[Any]] = set()

    def reload() -> None:
        task = asyncio.ensure_future(reloader.reload())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, reload)
    try:
        url = await app.start()
    except BaseException:
        await app.stop()
        raise
    print(f"kvroute serve listening on {url}", flush=True)
    for name, port, host in (
        ("gRPC API", app.grpc_port, config.grpc.host),
        ("ext_proc", app.extproc_port, config.extproc.host),
    ):
        if port is not None:
            shown = host or config.server.host
            shown = f"[{shown}]" if ":" in shown else shown
            print(f"kvroute serve {name} listening on {shown}:{port}", flush=True)
    log.info(
        "routing %d engine(s) with policy %s, index %s",
        len(app.registry),
        config.policy.name,
        config.index.backend,
    )
    watcher = asyncio.ensure_future(_watch_file(config_path, app, reload)) if config_path else None
    try:
        await stop.wait()
        log.info("shutting down: draining for up to %.0f s", app.config.server.drain_timeout_s)
        await app.drain(app.config.server.drain_timeout_s)
    finally:
        for task in (*reloads, *([watcher] if watcher else [])):
            task.cancel()
        await app.stop()
    return 0


async def _watch_file(path: str, app: Any, reload: Callable[[], None]) -> None:
    """Reload when the file's content changes (``server.reload_poll_s`` > 0)."""
    import hashlib
    from pathlib import Path

    def digest() -> bytes | None:
        try:
            return hashlib.sha256(Path(path).read_bytes()).digest()
        except OSError:
            return None  # a ConfigMap being swapped: try again next time

    seen = digest()
    while True:
        interval = app.config.server.reload_poll_s
        await asyncio.sleep(interval or 1.0)
        if not interval:
            continue
        now = digest()
        if now is not None and now != seen:
            seen = now
            log.info("configuration file %s changed: reloading", path)
            reload()


def _configure_logging(config: Config) -> None:
    from router.logs import configure_logging

    configure_logging(config.server.log_level, config.server.log_format)


def follow_logging(live: LiveConfig) -> None:
    """The process owns the logging setup: a reload that changes it sets it up again."""

    def reconfigure(new: Config, old: Config) -> None:
        shape = (new.server.log_level, new.server.log_format)
        if shape != (old.server.log_level, old.server.log_format):
            _configure_logging(new)

    live.subscribe("logging", ("server",), reconfigure)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"kvroute serve: {exc}", file=sys.stderr)
        return 2
    _configure_logging(config)
    for note in config.deprecations:
        log.warning("%s", note)
    if not config.engines and not config.discovery.kubernetes.enabled:
        print(
            "kvroute serve: no engines; pass --engine URL, list them in --config, or enable "
            "discovery.kubernetes",
            file=sys.stderr,
        )
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # uvloop is optional on platforms without it
        pass
    try:
        return asyncio.run(serve(config, lambda: config_from_args(args), args.config))
    except ConfigError as exc:
        print(f"kvroute serve: {exc}", file=sys.stderr)
        return 2
    except ListenError as exc:  # a taken port: one line, before any engine was contacted
        print(f"kvroute serve: {exc.strerror}", file=sys.stderr)
        return 1
