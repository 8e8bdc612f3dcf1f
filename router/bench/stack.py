"""Measure candidate HTTP stacks for the router's hot path, side by side in one run.

Each candidate is a minimal proxy (parse the JSON body, forward it, relay the answer)
in front of the same tiny upstream; the load generator runs in its own process.
``python -m router.bench.stack`` first prints the JSON libraries' table
(router/bench/codecs.py), then added latency (p50/p99 over direct) and throughput
relative to direct for every candidate: server framework x upstream client x event loop
(uvloop, as the router runs, or asyncio's default loop; each candidate reports the loop
it really runs). It informed the choices recorded in docs/benchmarks.md; it is not part
of the product's request path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import socket
import statistics
import time
from typing import Any

import aiohttp
from starlette.requests import Request

BODY = json.dumps({"model": "m", "prompt": "hello world " * 20, "max_tokens": 4}).encode()
ANSWER = json.dumps(
    {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "hi there"}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42},
    }
).encode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loop_name() -> str:
    loop = asyncio.get_running_loop()
    return f"{type(loop).__module__}.{type(loop).__name__}"


def _serve_upstream(port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import Route

    async def completions(request: Any) -> Response:
        await request.body()
        return Response(ANSWER, media_type="application/json")

    async def loop(request: Any) -> Response:
        return PlainTextResponse(_loop_name())

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/loop", loop, methods=["GET"]),
        ]
    )
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        log_level="error",
        loop="uvloop",
        http="httptools",
        access_log=False,
    )


def _serve_proxy(kind: str, port: int, upstream: str) -> None:
    import msgspec
    import uvicorn

    decoder = msgspec.json.Decoder()
    if kind.startswith("aiohttp.web"):
        # "aiohttp.web[+http1][/asyncio]": the router's server, with aiohttp's client or
        # router/http1.py's, on uvloop (as `kvroute serve` runs) or asyncio's own loop.
        from aiohttp import web

        from router.http1 import Client

        headers = {"content-type": "application/json"}

        async def handle(request: web.Request) -> web.Response:
            body = await request.read()
            decoder.decode(body)
            client = request.app["client"]
            if "+http1" in kind:
                r = await client.request("POST", upstream, body, headers)
                try:
                    data = await r.read()
                finally:
                    r.close()  # back to the keep-alive pool
            else:
                async with client.post(upstream, data=body, headers=headers) as r:
                    data = await r.read()
            return web.Response(body=data, content_type="application/json")

        async def loop(request: web.Request) -> web.Response:
            return web.Response(text=_loop_name())

        async def start(app: web.Application) -> None:
            app["client"] = Client() if "+http1" in kind else aiohttp.ClientSession()

        app = web.Application()
        app.on_startup.append(start)
        app.router.add_post("/v1/completions", handle)
        app.router.add_get("/loop", loop)
        if not kind.endswith("/asyncio"):
            import uvloop

            uvloop.install()
        web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)
        return

    from starlette.responses import PlainTextResponse, Response

    state: dict[str, Any] = {}

    async def handler(request: Request) -> Response:
        body = await request.body()
        decoder.decode(body)
        if kind.endswith("httpx"):
            r = await state["client"].post(
                upstream, content=body, headers={"content-type": "application/json"}
            )
            data = r.content
        else:
            async with state["client"].post(
                upstream, data=body, headers={"content-type": "application/json"}
            ) as r:
                data = await r.read()
        return Response(data, media_type="application/json")

    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> Any:
        if kind.endswith("httpx"):
            import httpx

            state["client"] = httpx.AsyncClient(limits=httpx.Limits(max_connections=256))
        else:
            state["client"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))
        yield

    async def loop(request: Request) -> Response:
        return PlainTextResponse(_loop_name())

    if kind.startswith("fastapi"):
        from fastapi import FastAPI

        app: Any = FastAPI(lifespan=lifespan)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await handler(request)

        app.add_api_route("/loop", loop, methods=["GET"])
    else:
        from starlette.applications import Starlette
        from starlette.routing import Route

        app = Starlette(
            routes=[
                Route("/v1/completions", handler, methods=["POST"]),
                Route("/loop", loop, methods=["GET"]),
            ],
            lifespan=lifespan,
        )
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        log_level="error",
        loop="uvloop",
        http="httptools",
        access_log=False,
    )


async def _load(url: str, requests: int, concurrency: int) -> tuple[list[float], float]:
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        queue = iter(range(requests))

        async def worker() -> None:
            for _ in queue:
                t0 = time.perf_counter()
                async with s.post(
                    url, data=BODY, headers={"content-type": "application/json"}
                ) as r:
                    if r.status != 200 or await r.read() != ANSWER:
                        raise RuntimeError(f"{url} answered {r.status}")
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - t0


async def _wait(port: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError(f"port {port} never opened")


KINDS = (
    "starlette+aiohttp",
    "fastapi+aiohttp",
    "starlette+httpx",
    "aiohttp.web",
    "aiohttp.web/asyncio",
    "aiohttp.web+http1",
    "aiohttp.web+http1/asyncio",
)
"""Proxy candidates: server+client, ``/asyncio`` for asyncio's default loop (otherwise
uvloop); ``aiohttp.web+http1`` is the router's own stack."""


def _cpu_seconds(pid: int) -> float:
    """User+system CPU time of a process so far (Linux /proc; NaN elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _http(args: argparse.Namespace) -> int:
    ctx = mp.get_context("spawn")
    up = _free_port()
    procs = [ctx.Process(target=_serve_upstream, args=(up,), daemon=True)]
    kinds = list(KINDS)
    ports = {k: _free_port() for k in kinds}
    upstream = f"http://127.0.0.1:{up}/v1/completions"
    procs += [
        ctx.Process(target=_serve_proxy, args=(k, ports[k], upstream), daemon=True) for k in kinds
    ]
    for p in procs:
        p.start()
    try:

        async def run() -> tuple[dict[str, Any], dict[str, str]]:
            for port in [up, *ports.values()]:
                await _wait(port)
            loops: dict[str, str] = {}
            async with aiohttp.ClientSession() as s:
                for name, port in ({"direct": up} | ports).items():
                    async with s.get(f"http://127.0.0.1:{port}/loop") as r:
                        loops[name] = (await r.text()).removeprefix("asyncio.unix_events.")
            targets = {"direct": upstream} | {
                k: f"http://127.0.0.1:{ports[k]}/v1/completions" for k in kinds
            }
            pids = {"direct": procs[0].pid} | {
                k: p.pid for k, p in zip(kinds, procs[1:], strict=True)
            }
            samples: dict[str, list[float]] = {name: [] for name in targets}
            rates: dict[str, list[float]] = {name: [] for name in targets}
            cpu = dict.fromkeys(targets, 0.0)
            served = dict.fromkeys(targets, 0)
            for url in targets.values():
                await _load(url, 300, 4)  # warm up
            # Interleave candidates round by round so drift on a shared machine hits all.
            serial_n, load_n = args.requests // (3 * args.rounds), args.requests // args.rounds
            for _ in range(args.rounds):
                for name, url in targets.items():
                    before = _cpu_seconds(pids[name])
                    serial, _ = await _load(url, serial_n, 1)
                    _, elapsed = await _load(url, load_n, args.concurrency)
                    cpu[name] += _cpu_seconds(pids[name]) - before
                    served[name] += serial_n + load_n
                    samples[name] += serial
                    rates[name].append(load_n / elapsed)
            out: dict[str, Any] = {}
            for name in targets:
                lat = sorted(samples[name])
                out[name] = {
                    "p50_ms": statistics.median(lat) * 1e3,
                    "p99_ms": lat[int(len(lat) * 0.99) - 1] * 1e3,
                    "rps": statistics.median(rates[name]),
                    "cpu_us": cpu[name] / served[name] * 1e6,
                }
            return out, loops

        results, loops = asyncio.run(run())
    finally:
        for p in procs:
            p.kill()
    base = results["direct"]
    # cpu µs/req: the serving process's CPU (the proxy's; the upstream's for direct).
    columns = ("p50 ms", "p99 ms", "added p50", "added p99", "rps", "vs direct", "cpu µs/req")
    print(f"{'stack':<27}{'loop':<28}" + "".join(f"{c:>11}" for c in columns))
    for name, r in results.items():
        cells = (
            f"{r['p50_ms']:.2f}",
            f"{r['p99_ms']:.2f}",
            f"{r['p50_ms'] - base['p50_ms']:.2f}",
            f"{r['p99_ms'] - base['p99_ms']:.2f}",
            f"{r['rps']:.0f}",
            f"{r['rps'] / base['rps']:.0%}",
            f"{r['cpu_us']:.0f}",
        )
        print(f"{name:<27}{loops[name]:<28}" + "".join(f"{c:>11}" for c in cells))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--only", choices=("json", "http"), help="run one part (default: JSON, then HTTP)"
    )
    parser.add_argument("--json-repeat", type=int, default=5, help="timeit runs per round")
    args = parser.parse_args(argv)
    if args.only != "http":
        from router.bench import codecs

        print(codecs.format_table(*codecs.measure(args.json_repeat, rounds=3)))
        if args.only is None:
            print()
    if args.only != "json":
        return _http(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
