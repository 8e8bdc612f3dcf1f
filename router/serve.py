"""``kvroute serve``: the router.

Stable quick-start flags (outside checks use them): ``--host``, ``--port`` (0 picks a
free port; the bound address is printed), ``--engine URL`` (repeatable), ``--policy``,
``--config FILE`` (YAML), ``--log-level``, ``--grpc-port`` and ``--extproc-port`` (the
gRPC API and the Envoy ext_proc endpoint picker; their bound addresses are printed too).
Flags override the YAML file and ``KVROUTE_*`` environment variables. One asyncio
process (uvloop); scale out with replicas sharing a Redis index, never with workers.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

from router.config import Config, ConfigError, load_config
from router.policy import POLICY_NAMES

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
        help="an engine serving prefill and decode (repeatable), e.g. http://10.0.0.5:8000",
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
        choices=["nixl", "sglang"],
        help="KV-transfer dialect between prefill and decode engines (default nixl)",
    )
    parser.add_argument(
        "--policy",
        choices=[*POLICY_NAMES, "default"],
        help="routing policy (default kv_cost)",
    )
    parser.add_argument(
        "--block-size", type=int, help="tokens per KV block; must match the engines (default 16)"
    )
    parser.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], help="log verbosity"
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
        for k, v in (("host", args.host), ("port", args.port), ("log_level", args.log_level))
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


async def serve(config: Config) -> int:
    from router.app import RouterApp

    app = RouterApp(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    url = await app.start()
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
    try:
        await stop.wait()
    finally:
        await app.stop()
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"kvroute serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not config.engines:
        print(
            "kvroute serve: no engines; pass --engine URL or list them in --config", file=sys.stderr
        )
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # uvloop is optional on platforms without it
        pass
    return asyncio.run(serve(config))
