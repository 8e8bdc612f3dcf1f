"""What ``kvroute bench`` sends a workload to, and starting it on loopback.

A target is ``NAME=SPEC`` (``--compare``) or ``SPEC`` (``--target``), where SPEC is:

* ``http://HOST:PORT``: a running OpenAI-compatible deployment (kvroute, an engine,
  another router). Bench reads the engines given with ``--engine-url`` for hit rates.
* ``policy:NAME``: ``kvroute serve --policy NAME``, started by bench in front of the
  engines (emulated ones it starts with ``--engines N``, or those of ``--engine-url``).
* ``cmd:COMMAND``: **the extension point for external routers** (sglang-router,
  vllm-router, ...): bench runs COMMAND with ``{engines}`` (engine URLs separated by
  spaces), ``{engines_csv}`` (by commas), ``{host}`` and ``{port}`` (a free loopback
  port) substituted, waits until ``http://{host}:{port}/v1/models`` answers, sends the
  workload there and stops the command's process group afterwards. For example::

      sglang=cmd:python -m sglang_router.launch_router --worker-urls {engines}
          --policy cache_aware --host {host} --port {port}

Everything bench starts listens on 127.0.0.1, runs in its own process group and is
stopped when the target's run ends, whatever happened.
"""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal

from router.policy import DEFAULT_POLICY, POLICY_NAMES
from router.process import EngineProcess, ServerProcess, start_group, stop_group

HOST = "127.0.0.1"
TargetKind = Literal["url", "policy", "cmd"]


class TargetError(ValueError):
    """A target that cannot be parsed or started."""


@dataclass(frozen=True, slots=True)
class Target:
    """One thing to benchmark."""

    name: str
    kind: TargetKind
    value: str
    """The URL, the policy name, or the command template."""

    @property
    def spec(self) -> str:
        return self.value if self.kind == "url" else f"{self.kind}:{self.value}"


def parse_target(text: str, name: str | None = None) -> Target:
    """Parse ``NAME=SPEC`` (or a bare SPEC, named ``name`` or after its policy)."""
    spec = text
    if not text.startswith(("http://", "https://", "policy:", "cmd:")) and "=" in text:
        name, spec = text.split("=", 1)
        if not name:
            raise TargetError(f"empty target name in {text!r}")
    if spec.startswith(("http://", "https://")):
        return Target(name or "target", "url", spec.rstrip("/"))
    kind, _, value = spec.partition(":")
    if kind == "policy":
        policy = DEFAULT_POLICY if value == "default" else value
        if policy not in POLICY_NAMES:
            raise TargetError(
                f"unknown kvroute policy {value!r} in {text!r}; one of {', '.join(POLICY_NAMES)}"
            )
        return Target(name or policy, "policy", policy)
    if kind == "cmd":
        if not value.strip():
            raise TargetError(f"empty command in {text!r}")
        return Target(name or "command", "cmd", value)
    raise TargetError(
        f"cannot read target {text!r}: expected NAME=URL, NAME=policy:POLICY or NAME=cmd:COMMAND"
    )


def free_port() -> int:
    """A loopback port that was free a moment ago (for commands that need a number)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    """GET ``url``: (status, body text); (status, "") for an error status, (0, "") when
    nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (urllib.error.URLError, OSError):
        return 0, ""


def wait_until(failure: str, check: Callable[[], bool], timeout: float) -> None:
    """Poll ``check`` until it holds; raise ``failure`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise TargetError(f"{failure} within {timeout:.0f} s")


def replays_ok(metrics_text: str) -> int:
    """Successful KV-event replays a kvroute router reports (one per subscribed engine)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("kvroute_kv_event_replays_total{") and 'outcome="ok"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def command_argv(
    template: str,
    engine_urls: Sequence[str],
    host: str,
    port: int,
    lists: dict[str, Sequence[str]] | None = None,
) -> list[str]:
    """The argument list of a ``cmd:`` target's template with its placeholders filled.

    A word that is exactly ``{engines}`` becomes one argument per engine (for flags
    that take several values, like ``--worker-urls``), and so do ``{kv_event_sources}``
    and ``{kv_event_replay_sources}`` (``URL=ENDPOINT`` per engine that publishes KV
    events, for vllm-router's ``--kv-event-source``) when ``lists`` provides them;
    ``{engines_csv}``, ``{host}``, ``{port}`` and ``{free_port}`` (another free loopback
    port, e.g. for a router's metrics listener) may appear anywhere in a word. A word
    ``{each:FLAG:LIST}`` becomes ``FLAG item`` for every item of list LIST, for flags
    given once per value (vllm-router's ``--kv-event-source``).
    """
    per_word = {"engines": list(engine_urls), **(lists or {})}
    values = {
        "engines": " ".join(engine_urls),
        "engines_csv": ",".join(engine_urls),
        "host": host,
        "port": str(port),
        "free_port": str(free_port()),
    }
    argv: list[str] = []
    try:
        for word in shlex.split(template):
            if word.startswith("{each:") and word.endswith("}"):
                flag, _, name = word[len("{each:") : -1].rpartition(":")
                for item in per_word[name]:
                    argv += [flag, item]
            elif word.startswith("{") and word.endswith("}") and word[1:-1] in per_word:
                argv.extend(per_word[word[1:-1]])
            else:
                argv.append(word.format(**values))
    except (KeyError, IndexError, ValueError) as exc:
        raise TargetError(f"bad command template {template!r}: {exc!r}") from exc
    return argv


class CommandProcess:
    """An external command in its own process group, output kept in a log file."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "wb")  # closed in stop()
        try:
            self.proc = start_group(
                argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
            )
        except OSError as exc:
            self._log.close()
            raise TargetError(f"cannot start {shlex.join(argv)}: {exc}") from exc

    def tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        stop_group(self.proc, grace=10.0)
        self._log.close()


@dataclass(slots=True)
class StackOptions:
    """How to build a target's stack."""

    engines: int = 0
    """Emulated engines to start per target (0: use ``engine_urls``)."""
    engine_cmd: str | None = None
    """A command template that starts one engine (a real vLLM, say) instead of
    ``kvroute engine``: ``{port}``, ``{i}`` and ``{dir}`` (the target's work directory)
    are filled in; the engine is ready when its ``/health`` answers 200."""
    engine_start_timeout: float = 600.0
    engine_args: tuple[str, ...] = ()
    engine_urls: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    start_timeout: float = 60.0


class Stack:
    """A target made ready to receive traffic: its engines, its router, its URL.

    Use as a context manager; leaving it stops everything it started.
    """

    def __init__(self, target: Target, options: StackOptions) -> None:
        self.target = target
        self.options = options
        self.url = ""
        self.engine_urls: list[str] = list(options.engine_urls)
        self._engines: list[EngineProcess] = []
        self._engine_commands: list[CommandProcess] = []
        self._router: ServerProcess | None = None
        self._command: CommandProcess | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="kvroute-bench-")
        self.workdir = Path(self._tmp.name)

    def __enter__(self) -> Stack:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _start(self) -> None:
        target, opts = self.target, self.options
        if target.kind == "url":
            if opts.engines:
                raise TargetError(
                    f"target {target.name} is a URL: bench cannot put engines it starts "
                    "behind it (use policy: or cmd: targets with --engines)"
                )
            self.url = target.value
            return
        if opts.engines:
            self._start_engines(opts.engines)
        if not self.engine_urls:
            raise TargetError(
                f"target {target.name} needs engines: --engines N or --engine-url URL"
            )
        if target.kind == "policy":
            self._start_kvroute(target.value)
        else:
            self._start_command(target.value)

    def _start_engines(self, count: int) -> None:
        if self.options.engine_cmd:
            return self._start_engine_commands(count, self.options.engine_cmd)

        def start(i: int) -> EngineProcess:
            return EngineProcess(
                [
                    "--port",
                    "0",
                    "--engine-id",
                    f"{self.target.name}-{i}",
                    "--kv-events-endpoint",
                    f"ipc://{self.workdir}/engine{i}-events",
                    "--kv-events-replay-endpoint",
                    f"tcp://{HOST}:*",
                    *self.options.engine_args,
                ],
                timeout=self.options.start_timeout,
            )

        # Start-up is mostly interpreter import time: overlap it.
        with ThreadPoolExecutor(max_workers=min(count, 4)) as pool:
            futures = [pool.submit(start, i) for i in range(count)]
            errors = []
            for future in futures:
                try:
                    self._engines.append(future.result())
                except Exception as exc:  # every engine is stopped below, whatever failed
                    errors.append(exc)
        if errors:
            raise TargetError(f"an emulated engine did not start: {errors[0]}")
        self.engine_urls = [e.url for e in self._engines]

    def _start_engine_commands(self, count: int, template: str) -> None:
        """``count`` engines from ``template`` (``--engine-cmd``), started side by side."""
        urls = []
        for i in range(count):
            port = free_port()
            # Plain replacement, not str.format: engine flags hold JSON braces.
            values = {
                "{port}": str(port),
                "{i}": str(i),
                "{dir}": str(self.workdir),
                "{host}": HOST,
            }
            argv = []
            for word in shlex.split(template):
                for name, value in values.items():
                    word = word.replace(name, value)
                argv.append(word)
            log = self.workdir / f"{self.target.name}-engine{i}.log"
            self._engine_commands.append(CommandProcess(argv, log))
            urls.append(f"http://{HOST}:{port}")
        for url, command in zip(urls, self._engine_commands, strict=True):

            def ready(url: str = url, command: CommandProcess = command) -> bool:
                if command.proc.poll() is not None:
                    raise TargetError(
                        f"engine {shlex.join(command.argv)} exited with status "
                        f"{command.proc.returncode}:\n{command.tail()}"
                    )
                return http_get(f"{url}/health")[0] == 200

            wait_until(f"engine at {url} was not ready", ready, self.options.engine_start_timeout)
        self.engine_urls = urls

    def _event_sources(self) -> dict[str, Sequence[str]]:
        """``URL=ENDPOINT`` of every engine that reports KV-event endpoints (/server_info)."""
        sources: list[str] = []
        replays: list[str] = []
        for url in self.engine_urls:
            status, body = http_get(f"{url}/server_info")
            if status != 200:
                continue
            info = json.loads(body or "{}")
            pub, replay = info.get("kv_events_endpoint"), info.get("kv_events_replay_endpoint")
            if pub:
                sources.append(f"{url}={pub.replace('0.0.0.0', HOST)}")
            if replay:
                replays.append(f"{url}={replay.replace('0.0.0.0', HOST)}")
        return {"kv_event_sources": sources, "kv_event_replay_sources": replays}

    def _start_kvroute(self, policy: str) -> None:
        args = ["--port", "0", "--policy", policy, "--log-level", "warning"]
        for url in self.engine_urls:
            args += ["--engine", url]
        self._router = ServerProcess("serve", [*args, *self.options.router_args])
        self.url = self._router.url
        timeout = self.options.start_timeout
        wait_until(
            f"kvroute serve at {self.url} was not ready",
            lambda: http_get(f"{self.url}/ready")[0] == 200,
            timeout,
        )
        started = len(self._engines) + len(self._engine_commands)
        if started:
            # Engines bench started publish KV events: send nothing before the router
            # follows every one of them, or the first requests would route blind.
            wait_until(
                f"kvroute serve did not follow the KV events of {started} engines",
                lambda: replays_ok(http_get(f"{self.url}/metrics")[1]) >= started,
                timeout,
            )

    def _start_command(self, template: str) -> None:
        port = free_port()
        argv = command_argv(template, self.engine_urls, HOST, port, self._event_sources())
        self.url = f"http://{HOST}:{port}"
        self._command = CommandProcess(argv, self.workdir / f"{self.target.name}.log")
        command = self._command

        def ready() -> bool:
            if command.proc.poll() is not None:
                raise TargetError(
                    f"{shlex.join(argv)} exited with status {command.proc.returncode}:\n"
                    f"{command.tail()}"
                )
            return http_get(f"{self.url}/v1/models")[0] == 200

        wait_until(
            f"{shlex.join(argv)} did not answer at {self.url}/v1/models",
            ready,
            self.options.start_timeout,
        )

    def close(self) -> None:
        """Stop everything this stack started (safe to call twice)."""
        if self._command is not None:
            self._command.stop()
            self._command = None
        if self._router is not None:
            self._router.stop()
            self._router = None
        for engine in self._engines:
            engine.stop()
        self._engines = []
        for command in self._engine_commands:
            command.stop()
        self._engine_commands = []
        self._tmp.cleanup()
