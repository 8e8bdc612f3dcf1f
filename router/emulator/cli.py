"""``kvroute engine``: run one emulated vLLM-compatible engine until SIGTERM or SIGINT.

Prints exactly one line to stdout once serving, containing ``listening on http://HOST:PORT``
(and the KV-event endpoints actually bound); logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import zmq

from router.emulator.config import DEFAULT_MODEL, HANDOFF_FAILURES, ROLES, EmulatorConfig
from router.emulator.faults import Faults
from router.emulator.kv_publisher import REPLAY_BUFFER
from router.emulator.server import start_engine
from router.engine_model.flags import add_model_arguments, engine_params, number, whole_number
from router.events.vllm import EVENT_FORMATS, REPLAY_FRAMES
from router.media import DEFAULT_MM_PLACEHOLDER_TOKENS

#: A TCP port flag (0: a free one).
PORT = whole_number(0, 65535)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``kvroute engine`` (docs/engine-emulator.md describes each)."""
    net = parser.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to listen on")
    net.add_argument("--port", type=PORT, default=8000, help="HTTP port; 0 picks a free one")
    net.add_argument("--model", default=DEFAULT_MODEL, help="served model name")
    net.add_argument("--engine-id", default=None, help="engine identity (default: random)")
    net.add_argument("--role", choices=ROLES, default="both", help="disaggregation role")
    net.add_argument(
        "--lora-modules",
        nargs="*",
        default=[],
        metavar="NAME",
        help="LoRA adapter names also served (listed by /v1/models)",
    )
    net.add_argument(
        "--default-max-tokens",
        type=whole_number(1),
        default=16,
        help="output length when a request sets no max_tokens (the emulator ignores EOS)",
    )
    net.add_argument(
        "--mm-placeholder-tokens",
        type=whole_number(1),
        default=DEFAULT_MM_PLACEHOLDER_TOKENS,
        metavar="N",
        help="prompt tokens each image, audio or video part of a chat takes (default "
        f"{DEFAULT_MM_PLACEHOLDER_TOKENS}; the router's tokenizer.mm_placeholder_tokens "
        "must agree)",
    )
    net.add_argument("--log-level", default="warning", help="log level on stderr")
    net.add_argument(
        "--dp-size",
        type=whole_number(1),
        default=1,
        help="data-parallel ranks behind the one HTTP port, each with its own cache",
    )

    add_model_arguments(parser)
    parser.add_argument("--hash-seed", type=int, help="root of the engine's block hashes")
    timing = parser.add_argument_group("real time")
    timing.add_argument(
        "--time-scale",
        type=number(above_zero=True),
        default=1.0,
        help="wall seconds per model second (0.01 runs 100x faster than real time)",
    )

    handoff = parser.add_argument_group("KV handoffs (disaggregated prefill and decode)")
    handoff.add_argument(
        "--side-channel-host",
        help="host of the NIXL side channel, listened on and reported (default: --host)",
    )
    handoff.add_argument(
        "--side-channel-port",
        type=PORT,
        default=0,
        help="NIXL side-channel port of rank 0, rank r uses port + r (0: free ports)",
    )
    handoff.add_argument(
        "--bootstrap-port",
        type=PORT,
        default=0,
        help="SGLang bootstrap listener port, with --role prefill (0: a free one)",
    )
    handoff.add_argument(
        "--bootstrap-timeout",
        type=number(above_zero=True),
        default=300.0,
        help="wall seconds one SGLang leg waits for the other to arrive",
    )
    security = parser.add_argument_group("security (as vLLM's --api-key, --ssl-certfile)")
    security.add_argument("--api-key", help="/v1/* answers 401 without 'Bearer API_KEY'")
    security.add_argument("--ssl-certfile", metavar="FILE", help="serve HTTPS with this PEM chain")
    security.add_argument("--ssl-keyfile", metavar="FILE", help="the PEM key of --ssl-certfile")
    handoff.add_argument(
        "--handoff-failure",
        choices=HANDOFF_FAILURES,
        default="recompute",
        help="unusable NIXL kv_transfer_params: recompute locally (vLLM) or fail (500)",
    )
    faults = parser.add_argument_group("fault injection (also at run time: /admin/faults)")
    faults.add_argument(
        "--fail-rate", type=float, default=0.0, help="fraction of requests answered 500"
    )
    faults.add_argument(
        "--extra-latency-ms",
        type=float,
        default=0.0,
        help="wall milliseconds added before a request reaches the engine",
    )
    faults.add_argument(
        "--stall-after-tokens",
        type=int,
        metavar="N",
        help="stop sending after N output tokens but keep the connection open",
    )
    faults.add_argument(
        "--drop-after-tokens",
        type=int,
        metavar="N",
        help="close the connection after N output tokens",
    )
    faults.add_argument(
        "--garble-after-tokens",
        type=int,
        metavar="N",
        help="after N output tokens send bytes that are not SSE (streams) or invalid JSON",
    )
    faults.add_argument("--fail-health", action="store_true", help="/health answers 503")
    faults.add_argument(
        "--kv-events-skip",
        type=int,
        default=0,
        metavar="N",
        help="keep the next N KV-event batches for replay but do not publish them",
    )
    faults.add_argument(
        "--kv-events-garbage",
        type=int,
        default=0,
        metavar="N",
        help="publish a malformed message before each of the next N KV-event batches",
    )

    events = parser.add_argument_group("KV events")
    events.add_argument(
        "--kv-events-endpoint",
        help="ZMQ PUB endpoint; binds with '*', '::', ipc:// or inproc://, else connects",
    )
    events.add_argument("--kv-events-replay-endpoint", help="ZMQ ROUTER endpoint for replay")
    events.add_argument(
        "--kv-events-buffer-steps",
        type=whole_number(1),
        default=REPLAY_BUFFER,
        metavar="N",
        help=f"batches kept for replay (vLLM's buffer_steps; default {REPLAY_BUFFER})",
    )
    events.add_argument(
        "--kv-events-topic",
        help="topic of every message (default: kv@HOST:PORT@MODEL; '' is vLLM's default)",
    )
    events.add_argument(
        "--kv-events-format",
        choices=EVENT_FORMATS,
        default="v2-mixed",
        help="payload shape: v2-mixed (vLLM 0.32: an array batch of map events), v1-array "
        "(older vLLM: positional events), v3-map (a map batch: other publishers), sglang "
        "(SGLang's publisher: positional per-page events, signed hashes, legacy replay "
        "frames), trtllm (TensorRT-LLM's get_kv_cache_events() list, relayed on ZMQ)",
    )
    events.add_argument(
        "--kv-events-curve-key",
        metavar="FILE",
        help="publish with this CURVE key (a NAME.key_secret certificate) to a router whose "
        "bound KV-event socket asks for CURVE; needs --kv-events-curve-server-key",
    )
    events.add_argument(
        "--kv-events-curve-server-key",
        metavar="FILE",
        help="the router's public CURVE key (its NAME.key certificate)",
    )
    events.add_argument(
        "--kv-events-replay-frames",
        choices=REPLAY_FRAMES,
        default="topic",
        help="replay replies: topic (vLLM 0.32: [b'', topic, seq, payload]) or legacy "
        "(older vLLM: [b'', seq, payload])",
    )


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    optional = {"engine_id": args.engine_id} if args.engine_id else {}
    return EmulatorConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        role=args.role,
        params=engine_params(args),
        hash_seed=args.hash_seed,
        time_scale=args.time_scale,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_topic=args.kv_events_topic,
        kv_events_format=args.kv_events_format,
        kv_events_replay_frames=args.kv_events_replay_frames,
        kv_events_buffer_steps=args.kv_events_buffer_steps,
        kv_events_curve_key=args.kv_events_curve_key,
        kv_events_curve_server_key=args.kv_events_curve_server_key,
        lora_modules=tuple(args.lora_modules),
        default_max_tokens=args.default_max_tokens,
        mm_placeholder_tokens=args.mm_placeholder_tokens,
        dp_size=args.dp_size,
        side_channel_host=args.side_channel_host,
        side_channel_port=args.side_channel_port,
        bootstrap_port=args.bootstrap_port,
        bootstrap_timeout_s=args.bootstrap_timeout,
        handoff_failure=args.handoff_failure,
        tls_cert_file=args.ssl_certfile,
        tls_key_file=args.ssl_keyfile,
        api_key=args.api_key,
        faults=Faults(
            fail_rate=args.fail_rate,
            extra_latency_ms=args.extra_latency_ms,
            stall_after_tokens=args.stall_after_tokens,
            drop_after_tokens=args.drop_after_tokens,
            garble_after_tokens=args.garble_after_tokens,
            fail_health=args.fail_health,
            kv_events_skip=args.kv_events_skip,
            kv_events_garbage=args.kv_events_garbage,
        ),
        **optional,
    )


async def _serve(config: EmulatorConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine = await start_engine(config)
    try:
        print(engine.startup_line(), flush=True)
        await stop.wait()
    finally:
        await engine.stop()


def run(args: argparse.Namespace) -> int:
    """Entry point of ``kvroute engine``."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"kvroute engine: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        runner(_serve(config))
    except zmq.ZMQError as exc:  # an unusable ZMQ endpoint: say which, without a traceback
        print(f"kvroute engine: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a taken port: its strerror names the address
        print(f"kvroute engine: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0
