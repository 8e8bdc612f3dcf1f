"""Measure candidate HTTP stacks for the router's hot path, side by side in one run.

Each candidate is a minimal proxy (parse the JSON body, forward it, relay the answer)
in front of the same tiny upstream; the load generator runs in its own process.
``python -m router.bench.stack`` prints added latency (p50/p99 over direct) and
throughput relative to direct for every candidate. It informed the choice recorded in
docs/benchmarks.md; it is not part of the product's request path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
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


def _serve_upstream(port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    async def completions(request: Any) -> Response:
        await request.body()
        return Response(ANSWER, media_type="application/json")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
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
    if kind == "aiohttp.web":
        from aiohttp import web

        async def handle(request: web.Request) -> web.Response:
            body = await request.read()
            decoder.decode(body)
            session = request.app["session"]
            async with session.post(
                upstream, data=body, headers={"content-type": "application/json"}
            ) as r:
                data = await r.read()
            return web.Response(body=data, content_type="application/json")

        async def start(app: web.Application) -> None:
            app["session"] = aiohttp.ClientSession()

        app = web.Application()
        app.on_startup.append(start)
        app.router.add_post("/v1/completions", handle)
        import uvloop

        uvloop.install()
        web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)
        return

    from starlette.responses import Response

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

    if kind.startswith("fastapi"):
        from fastapi import FastAPI

        app: Any = FastAPI(lifespan=lifespan)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await handler(request)
    else:
        from starlette.applications import Starlette
        from starlette.routing import Route

        app = Starlette(
            routes=[Route("/v1/completions", handler, methods=["POST"])], lifespan=lifespan
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    up = _free_port()
    procs = [ctx.Process(target=_serve_upstream, args=(up,), daemon=True)]
    kinds = ["starlette+aiohttp", "fastapi+aiohttp", "starlette+httpx", "aiohttp.web"]
    ports = {k: _free_port() for k in kinds}
    upstream = f"http://127.0.0.1:{up}/v1/completions"
    procs += [
        ctx.Process(target=_serve_proxy, args=(k, ports[k], upstream), daemon=True) for k in kinds
    ]
    for p in procs:
        p.start()
    try:

        async def run() -> dict[str, Any]:
            for port in [up, *ports.values()]:
                await _wait(port)
            targets = {"direct": upstream} | {
                k: f"http://127.0.0.1:{ports[k]}/v1/completions" for k in kinds
            }
            samples: dict[str, list[float]] = {name: [] for name in targets}
            rates: dict[str, list[float]] = {name: [] for name in targets}
            for url in targets.values():
                await _load(url, 300, 4)  # warm up
            # Interleave candidates round by round so drift on a shared machine hits all.
            for _ in range(args.rounds):
                for name, url in targets.items():
                    serial, _ = await _load(url, args.requests // (3 * args.rounds), 1)
                    _, elapsed = await _load(url, args.requests // args.rounds, args.concurrency)
                    samples[name] += serial
                    rates[name].append(args.requests // args.rounds / elapsed)
            out: dict[str, Any] = {}
            for name in targets:
                lat = sorted(samples[name])
                out[name] = {
                    "p50_ms": statistics.median(lat) * 1e3,
                    "p99_ms": lat[int(len(lat) * 0.99) - 1] * 1e3,
                    "rps": statistics.median(rates[name]),
                }
            return out

        results = asyncio.run(run())
    finally:
        for p in procs:
            p.kill()
    base = results["direct"]
    columns = ("p50 ms", "p99 ms", "added p50", "added p99", "rps", "vs direct")
    print(f"{'stack':<20}" + "".join(f"{c:>11}" for c in columns))
    for name, r in results.items():
        cells = (
            f"{r['p50_ms']:.2f}",
            f"{r['p99_ms']:.2f}",
            f"{r['p50_ms'] - base['p50_ms']:.2f}",
            f"{r['p99_ms'] - base['p99_ms']:.2f}",
            f"{r['rps']:.0f}",
            f"{r['rps'] / base['rps']:.0%}",
        )
        print(f"{name:<20}" + "".join(f"{c:>11}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
