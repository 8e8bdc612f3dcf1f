"""``make compat``: peer routers (sglang-router, vllm-router) in front of emulated engines.

Each router is installed from PyPI into its own virtualenv under ``build/compat/`` and
run as a child process on loopback, first in its regular mode over two engines, then in
its prefill/decode mode over a prefill and a decode engine (SGLang's bootstrap dialect
for sglang-router, vLLM's NIXL dialect for vllm-router). A small relay in front of each
engine records every call the router makes (health, metadata, tokenize/render probes,
generation), so the output shows what each router asked and what the emulator answered.
Disaggregated requests count as passed only if the decode engine's own counter shows the
KV was handed over.

Everything listens on 127.0.0.1. Not part of ``make test``: it needs PyPI and takes a
minute the first time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from router.process import EngineProcess, start_group, stop_group

HOST = "127.0.0.1"
#: Versions known to work; change deliberately (the output names what ran).
PACKAGES = {"sglang-router": "sglang-router==0.3.2", "vllm-router": "vllm-router==0.1.17"}
_READY_TIMEOUT_S = 60.0
_PROMPT = " ".join(f"w{i}" for i in range(300))


@dataclass
class Relay:
    """An HTTP relay in front of one engine that records (method, path, status)."""

    name: str
    target: str
    calls: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    url: str = ""
    _runner: web.AppRunner | None = None
    _session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, HOST, 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{HOST}:{port}"

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        body = await request.read()
        skip = {"host", "content-length", "transfer-encoding", "connection"}
        headers = {k: v for k, v in request.headers.items() if k.lower() not in skip}
        try:
            async with self._session.request(
                request.method, self.target + request.path_qs, data=body, headers=headers
            ) as upstream:
                self.calls[(request.method, request.path, upstream.status)] += 1
                response = web.StreamResponse(status=upstream.status)
                for name in ("content-type", "x-request-id", "x-kvroute-handoff"):
                    if name in upstream.headers:
                        response.headers[name] = upstream.headers[name]
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except aiohttp.ClientError:
            self.calls[(request.method, request.path, 502)] += 1
            return web.Response(status=502)

    def summary(self) -> str:
        parts = []
        for (method, path, status), count in sorted(self.calls.items()):
            parts.append(f"{method} {path} {status}" + (f" x{count}" if count > 1 else ""))
        return ", ".join(parts) or "none"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def install_into(venv: Path, spec: str, command: str) -> tuple[Path | None, str]:
    """``command`` of the PyPI package ``spec`` in its own virtualenv ``venv`` (installed
    there if it is not yet), or None and the precise reason it could not be installed."""
    executable = venv / "bin" / command
    stamp = venv / f".installed-{spec}"
    if stamp.exists() and executable.exists():
        return executable, spec
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", "--clear", str(venv)],
            check=True,
            capture_output=True,
            text=True,
        )
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check", spec],
            check=True,
            capture_output=True,
            text=True,
            timeout=900,
        )
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or exc.stdout or "").strip().splitlines()[-5:]
        return None, f"cannot install {spec}: " + " | ".join(tail)
    except subprocess.TimeoutExpired:
        return None, f"cannot install {spec}: pip did not finish within 900 s"
    if not executable.exists():
        return None, f"{spec} installed no '{command}' command"
    stamp.touch()
    return executable, spec


def install(build_dir: Path, name: str) -> tuple[Path | None, str]:
    """The router's executable in its own virtualenv (installed if needed), or None and
    the precise reason it could not be installed."""
    return install_into(build_dir / name, PACKAGES[name], name)


class RouterProcess:
    """A peer router as a child process in its own process group, on loopback."""

    def __init__(self, args: Sequence[str]) -> None:
        self.port = _free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = start_group(
            [*args, "--port", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT
        )

    def output_tail(self, lines: int = 8) -> str:
        self.log.seek(0)
        return "\n".join(self.log.read().strip().splitlines()[-lines:])

    def stop(self) -> None:
        stop_group(self.proc, grace=10.0)
        self.log.close()


async def _metric(http: aiohttp.ClientSession, url: str, name: str) -> float:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    )


async def _complete(http: aiohttp.ClientSession, url: str, chat: bool, stream: bool) -> str:
    """One request through the router; '' on success, else what went wrong."""
    if chat:
        path = "/v1/chat/completions"
        body: dict[str, Any] = {"messages": [{"role": "user", "content": _PROMPT}]}
    else:
        path, body = "/v1/completions", {"prompt": _PROMPT}
    body.update({"model": "kvroute-emulated", "max_tokens": 4, "stream": stream})
    try:
        async with http.post(url + path, json=body) as resp:
            text = await resp.text()
    except aiohttp.ClientError as exc:
        return f"{path}: {exc}"
    if resp.status != 200:
        return f"{path}: HTTP {resp.status} {text[:200]}"
    if stream and "data: [DONE]" not in text:
        return f"{path}: stream without [DONE]"
    if not stream and '"choices"' not in text:
        return f"{path}: no choices in {text[:200]}"
    return ""


async def _ready(http: aiohttp.ClientSession, router: RouterProcess) -> str:
    """Wait until the router routes a request; '' when it does, else why not."""
    deadline = time.monotonic() + _READY_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
        if router.proc.poll() is not None:
            return f"exited with status {router.proc.returncode}: {router.output_tail()}"
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(f"{router.url}/v1/models") as resp:
                if resp.status == 200:
                    last = await _complete(http, router.url, chat=False, stream=False)
                    if not last:
                        return ""
        await asyncio.sleep(0.5)
    return f"not routing within {_READY_TIMEOUT_S:g} s ({last or 'no answer'})"


@contextlib.asynccontextmanager
async def _engines(roles: Sequence[str]) -> AsyncIterator[list[tuple[EngineProcess, Relay]]]:
    """Emulated engines (child processes) with a recording relay in front of each."""
    started: list[tuple[EngineProcess, Relay]] = []
    try:
        for i, role in enumerate(roles):
            args = ["--port", "0", "--role", role, "--engine-id", f"{role}-{i}"]
            args += ["--time-scale", "0.01", "--cache-blocks", "2048", "--handoff-failure", "error"]
            engine = EngineProcess(args)
            relay = Relay(f"{role}-{i}", engine.url)
            started.append((engine, relay))
            await relay.start()
        yield started
    finally:
        for engine, relay in started:
            await relay.stop()
            engine.stop()


@dataclass
class Scenario:
    router: str
    mode: str
    ok: bool
    lines: list[str]


async def _run_regular(http: aiohttp.ClientSession, name: str, executable: Path) -> Scenario:
    async with _engines(["both", "both"]) as engines:
        relays = [relay for _, relay in engines]
        # cache_aware: the policy that asks engines to tokenize or render prompts.
        args = [str(executable), *_common_args(name), "--policy", "cache_aware"]
        args += ["--worker-urls", *(r.url for r in relays)]
        problem, lines = await _drive(http, args, disaggregated=False, decode_url=None)
        lines += [f"{r.name} engine answered: {r.summary()}" for r in relays]
        return Scenario(name, "regular (cache_aware, 2 engines)", not problem, [problem, *lines])


async def _run_pd(http: aiohttp.ClientSession, name: str, executable: Path) -> Scenario:
    async with _engines(["prefill", "decode"]) as engines:
        (prefill, p_relay), (decode, d_relay) = engines
        async with http.get(f"{prefill.url}/server_info") as resp:
            bootstrap = str((await resp.json())["bootstrap_port"])
        args = [str(executable), *_common_args(name), "--policy", "round_robin"]
        if name == "sglang-router":
            mode = "prefill/decode, SGLang bootstrap"
            args += ["--pd-disaggregation", "--prefill", p_relay.url, bootstrap]
        else:
            mode = "prefill/decode, NIXL"
            args += ["--vllm-pd-disaggregation", "--prefill", p_relay.url]
        args += ["--decode", d_relay.url]
        problem, lines = await _drive(http, args, disaggregated=True, decode_url=decode.url)
        lines += [f"{r.name} engine answered: {r.summary()}" for r in (p_relay, d_relay)]
        return Scenario(name, mode, not problem, [problem, *lines])


def _common_args(name: str) -> list[str]:
    prometheus = ["--prometheus-host", HOST, "--prometheus-port", str(_free_port())]
    if name == "sglang-router":
        return ["launch", "--host", HOST, *prometheus, "--worker-startup-check-interval", "1"]
    return ["--host", HOST, *prometheus, "--worker-startup-check-interval", "1"]


async def _drive(
    http: aiohttp.ClientSession, args: list[str], disaggregated: bool, decode_url: str | None
) -> tuple[str, list[str]]:
    """Start a router, send requests through it; (problem or '', report lines)."""
    router = RouterProcess(args)
    try:
        not_ready = await _ready(http, router)
        if not_ready:
            return f"router not ready: {not_ready}", []
        pulled_name = "kvroute_emulator_kv_pulled_tokens_total"
        before = await _metric(http, decode_url, pulled_name) if decode_url else 0.0
        requests = [(False, False), (True, False), (False, True), (True, True)]
        failures = [
            f for chat, stream in requests if (f := await _complete(http, router.url, chat, stream))
        ]
        lines = [f"{len(requests) - len(failures)}/{len(requests)} requests answered 200 "]
        lines[0] += "(completion and chat, plain and streamed)"
        if failures:
            return "; ".join(failures), lines
        if disaggregated and decode_url:
            pulled = await _metric(http, decode_url, pulled_name) - before
            lines.append(f"decode engine pulled {pulled:g} prompt tokens of KV from prefill")
            if pulled <= 0:
                return "the decode engine pulled no KV: the handoff did not happen", lines
        return "", lines
    finally:
        router.stop()


async def run(build_dir: Path) -> int:
    print("kvroute compat: peer routers in front of emulated engines (loopback only)")
    scenarios: list[Scenario] = []
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for name in PACKAGES:
            executable, spec = await asyncio.to_thread(install, build_dir, name)
            if executable is None:
                scenarios.append(Scenario(name, "install", False, [spec]))
                print(f"\n{name}: NOT RUN, {spec}")
                continue
            print(f"\n{spec} ({executable})")
            for runner in (_run_regular, _run_pd):
                scenario = await runner(http, name, executable)
                scenarios.append(scenario)
                print(f"  {'ok  ' if scenario.ok else 'FAIL'} {scenario.mode}")
                for line in scenario.lines:
                    if line:
                        print(f"       {line}")
    passed = sum(s.ok for s in scenarios)
    print(f"\n{passed} passed, {len(scenarios) - passed} failed")
    return 0 if passed == len(scenarios) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--build-dir", default="build/compat", type=Path)
    parser.add_argument(
        "--install-only",
        action="store_true",
        help="install the peer routers and print their executables; run nothing",
    )
    args = parser.parse_args(argv)
    args.build_dir.mkdir(parents=True, exist_ok=True)
    if args.install_only:
        failed = 0
        for name in PACKAGES:
            executable, detail = install(args.build_dir, name)
            print(f"{name}: {executable or 'not installed'} ({detail})")
            failed += executable is None
        return 1 if failed else 0
    # sglang-router first tries gRPC on each worker; aiohttp (the relay) would print a
    # traceback for every HTTP/2 preface it refuses.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    return asyncio.run(run(args.build_dir))


if __name__ == "__main__":
    sys.exit(main())
