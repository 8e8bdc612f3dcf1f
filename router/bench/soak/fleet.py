"""The soak's fleet: Redis, the engines and the router, and the faults done to them.

:class:`Fleet` starts each on loopback in its own process group (a throw-away
``redis-server`` on a free port, never the machine's own Redis), restarts an engine or
Redis where the router knows it, and stops whatever runs. :func:`inject_faults` runs
:func:`fault_plan` against it; :func:`sample_fleet` records the router's memory and CPU,
the soak's and the machine's CPU, and the router's Redis outages.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from router.bench.overhead import cpu_seconds
from router.bench.soak.report import FaultWindow, Sample, router_counters
from router.bench.targets import HOST, free_port, http_get, replays_ok, wait_until
from router.bench.throwaway_redis import RedisServer
from router.fleet.registry import endpoint_of
from router.process import EngineProcess, ServerProcess, stop_group

ENGINES = 4
#: Emulated-engine settings besides ``--max-num-seqs`` and ``--time-scale`` (flags of the
#: soak): a small cache keeps blocks being evicted, so the index never stops changing.
ENGINE_ARGS = ("--cache-blocks", "2048")
#: Router settings besides the Redis index: deadlines short enough that a stalled engine
#: shows within seconds (the defaults, 120 s to the first byte and 60 s of silence, are
#: for real prefills), and JSON logs the report can count.
ROUTER_CONFIG: dict[str, Any] = {
    "proxy": {"first_byte_timeout_s": 20.0, "idle_timeout_s": 5.0},
    "server": {"log_level": "warning", "log_format": "json"},
}
#: The router's ``index.redis.budget_ms`` in the soak. With its default, 5 ms, on two cores that
#: run everything, lookups Redis answers in 0.1 ms often take longer than 5 ms to reach
#: the router's handler: every such call marks the index down, and about half the
#: decisions of a soak are made without it (docs/reliability.md shows such a run).
REDIS_BUDGET_MS = 50.0


def fault_plan(duration: float) -> list[tuple[str, float, float]]:
    """(fault, start, how long) for a soak of ``duration`` seconds.

    At 25%, 45% and 65% of the run (2:30, 4:30, 6:30 in ten minutes), so each fault has
    clean minutes before it and the last minutes show the recovery. Down times are
    5 s; the stall lasts 5% of the run, at least 10 s and at most 30 s.
    """
    stall = min(30.0, max(10.0, 0.05 * duration))
    return [
        ("engine restart", 0.25 * duration, 5.0),
        ("redis restart", 0.45 * duration, 5.0),
        ("engine stall", 0.65 * duration, stall),
    ]


def read_rss_kib(pid: int) -> int:
    """``VmRSS`` of a process, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


def host_busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (all but idle and iowait), all cores."""
    with open("/proc/stat") as f:
        values = [float(v) for v in f.readline().split()[1:8]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


class Fleet:
    """Redis, the engines and the router of one soak, each in its own process group.

    Engines keep their HTTP, replay and event addresses across restarts, so the router
    finds a restarted engine where it was. :meth:`close` stops whatever is running.
    """

    def __init__(
        self,
        engines: int,
        engine_args: Sequence[str],
        start_timeout: float,
        index_options: dict[str, Any] | None = None,
        index_backend: str = "redis",
    ) -> None:
        self.index_backend = index_backend
        """``index.backend`` of the router: ``redis`` or ``replicated``."""
        self._tmp = tempfile.TemporaryDirectory(prefix="kvroute-soak-")
        self.workdir = Path(self._tmp.name)
        self.engine_args = list(engine_args)
        self.start_timeout = start_timeout
        self.redis: RedisServer | None = None
        self.redis_port = 0
        self.ports = [free_port() for _ in range(engines)]
        self.replay_ports = [free_port() for _ in range(engines)]
        self.engines: list[EngineProcess | None] = [None] * engines
        self.router: ServerProcess | None = None
        self.namespace = f"kvroute-soak-{uuid.uuid4().hex[:8]}"
        self.index_options = dict(index_options or {})

    @property
    def engine_urls(self) -> list[str]:
        return [f"http://{HOST}:{port}" for port in self.ports]

    @property
    def router_url(self) -> str:
        assert self.router is not None
        return self.router.url

    @property
    def router_pid(self) -> int:
        assert self.router is not None
        return self.router.proc.pid

    def pids(self) -> list[int]:
        """Every process of the soak running now (this one included)."""
        procs = [e.proc for e in self.engines if e is not None]
        procs += [p.proc for p in (self.router, self.redis) if p is not None]
        return [os.getpid(), *(p.pid for p in procs if p.poll() is None)]

    def router_config(self) -> dict[str, Any]:
        assert self.redis is not None
        # index_options: keys of the router's index.redis section (budget_ms).
        redis = {"url": self.redis.url, "namespace": self.namespace, **self.index_options}
        return {"index": {"backend": self.index_backend, "redis": redis}, **ROUTER_CONFIG}

    def start(self) -> None:
        self.redis = RedisServer()
        self.redis_port = self.redis.port
        for i in range(len(self.engines)):
            self.start_engine(i)
        config = self.workdir / "router.yaml"
        config.write_text(json.dumps(self.router_config(), indent=2))  # JSON is YAML
        args = ["--port", "0", "--config", str(config)]
        for url in self.engine_urls:
            args += ["--engine", url]
        self.router = ServerProcess("serve", args, timeout=self.start_timeout)
        url = self.router.url
        wait_until(
            f"kvroute serve at {url} was not ready", lambda: http_get(f"{url}/ready")[0] == 200, 60
        )
        wait_until(
            f"kvroute serve did not follow the KV events of {len(self.engines)} engines",
            lambda: replays_ok(http_get(f"{url}/metrics")[1]) >= len(self.engines),
            60,
        )

    def start_engine(self, i: int) -> None:
        self.engines[i] = EngineProcess(
            [
                "--port", str(self.ports[i]),
                "--engine-id", f"soak-{i}",
                "--kv-events-endpoint", f"ipc://{self.workdir}/engine{i}-events",
                "--kv-events-replay-endpoint", f"tcp://{HOST}:{self.replay_ports[i]}",
                "--log-level", "warning",
                *self.engine_args,
            ],
            timeout=self.start_timeout,
        )  # fmt: skip

    def kill_engine(self, i: int) -> None:
        """SIGKILL engine ``i``'s process group (no drain, like a crashed pod)."""
        engine = self.engines[i]
        self.engines[i] = None
        if engine is not None:
            stop_group(engine.proc, grace=0, kill_wait=10.0)
            engine.stop()

    def kill_redis(self) -> None:
        if self.redis is not None:
            self.redis.kill()
            self.redis = None

    def start_redis(self) -> None:
        """A new, empty ``redis-server`` on the port the router knows."""
        self.redis = RedisServer(port=self.redis_port)

    def router_metrics(self) -> str:
        """The router's /metrics text (empty if it does not answer)."""
        return http_get(f"{self.router_url}/metrics", timeout=10)[1]

    def router_log(self) -> str:
        """What the router wrote to stderr so far."""
        assert self.router is not None
        self.router.stderr.flush()
        self.router.stderr.seek(0)
        return self.router.stderr.read()

    def close(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None
        for i in range(len(self.engines)):
            engine = self.engines[i]
            if engine is not None:
                engine.stop()
                self.engines[i] = None
        self.kill_redis()
        self._tmp.cleanup()


async def inject_faults(
    fleet: Fleet,
    session: aiohttp.ClientSession,
    origin: float,
    duration: float,
    windows: list[FaultWindow],
) -> None:
    """Run :func:`fault_plan`, recording each fault's real start and end."""

    def now() -> float:
        return time.monotonic() - origin

    restart, stall = 1, 2  # which engines (0-based) suffer
    for name, at, hold in fault_plan(duration):
        await asyncio.sleep(max(0.0, at - now()))
        start = now()
        if name == "engine restart":
            await asyncio.to_thread(fleet.kill_engine, restart)
            await asyncio.sleep(hold)
            await asyncio.to_thread(fleet.start_engine, restart)
            engine = endpoint_of(fleet.engine_urls[restart])
        elif name == "redis restart":
            await asyncio.to_thread(fleet.kill_redis)
            await asyncio.sleep(hold)
            await asyncio.to_thread(fleet.start_redis)
            engine = None
        else:
            url = f"{fleet.engine_urls[stall]}/admin/faults"
            async with session.post(url, json={"stall_after_tokens": 4}) as resp:
                resp.raise_for_status()
            await asyncio.sleep(hold)
            async with session.delete(url) as resp:
                resp.raise_for_status()
            engine = endpoint_of(fleet.engine_urls[stall])
        windows.append(FaultWindow(name, start, now(), engine))
        print(f"fault: {name} from {start:.1f} s to {now():.1f} s", flush=True)


async def sample_fleet(
    fleet: Fleet,
    session: aiohttp.ClientSession,
    origin: float,
    every: float,
    out: list[Sample],
) -> None:
    """Append a :class:`Sample` to ``out`` every ``every`` seconds until cancelled or
    the router is gone (times from ``origin``, a ``time.monotonic()`` value)."""
    router, me = fleet.router_pid, os.getpid()
    seen: dict[int, float] = {}  # CPU seconds per process at its last sample
    soak = outages = 0.0
    while True:
        try:
            async with session.get(f"{fleet.router_url}/metrics") as resp:
                text = await resp.text()
            outages = router_counters(text, ["kvroute_index_outages_total"]).get(
                "kvroute_index_outages_total", 0.0
            )
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            pass  # keep the last value
        for pid in fleet.pids():
            try:
                now = cpu_seconds(pid)
            except (OSError, IndexError):  # it ended meanwhile
                continue
            soak += now - seen.get(pid, 0.0)
            seen[pid] = now
        try:
            rss = read_rss_kib(router)
        except OSError:  # the router is gone: the requests' outcomes tell the rest
            return
        t = time.monotonic() - origin
        cpu = seen.get(router, 0.0)
        out.append(Sample(t, rss, cpu, soak, seen[me], host_busy_seconds(), outages))
        await asyncio.sleep(every)
