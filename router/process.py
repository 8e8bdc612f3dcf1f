"""Child processes in their own process group, and kvroute servers run that way.

:func:`start_group` starts a command in its own session (so its own process group),
:func:`signal_group` signals that group, and :func:`stop_group` ends it: SIGTERM, a
grace period, SIGKILL, then the leader is reaped. Signals go to the group, so whatever
the child started ends with it, and never the caller. The demo, the benchmarks, the
peer-router comparison and the tests' Envoy and vLLM helpers all use these three.

:class:`ServerProcess` runs a kvroute server (``kvroute engine``, ``kvroute serve``,
...) that way. Every kvroute server prints one line containing
``listening on http://HOST:PORT`` once it is ready; that line gives the address.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

#: Every kvroute server prints one line with this when it is ready.
LISTENING = re.compile(r"listening on (http://\S+)")

#: What :func:`start_group` accepts for stdin, stdout and stderr (as ``subprocess.Popen``).
Stream = int | IO[Any] | None


def start_group(
    argv: Sequence[str],
    *,
    stdin: Stream = None,
    stdout: Stream = None,
    stderr: Stream = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    text: bool = False,
) -> subprocess.Popen[Any]:
    """Start ``argv`` in its own session, so in a process group of its own (the child's
    pid is the group's id)."""
    return subprocess.Popen(
        list(argv),
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        env=env,
        cwd=cwd,
        text=text,
        start_new_session=True,
    )


def signal_group(proc: subprocess.Popen[Any], sig: int) -> bool:
    """Send ``sig`` to ``proc``'s process group; False when the group is gone.

    Nothing is sent once ``proc`` has been reaped (``returncode`` set): its id may name
    another process's group by then.
    """
    if proc.returncode is not None:
        return False
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return False
    return True


def _exited(proc: subprocess.Popen[Any], timeout: float) -> bool:
    """Wait up to ``timeout`` s for ``proc`` to exit, without reaping it where the
    platform allows: an unreaped leader keeps its group's id from being reused."""
    if not hasattr(os, "waitid"):
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
    deadline = time.monotonic() + timeout
    while True:
        if proc.returncode is not None:
            return True
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:  # reaped by someone else (Popen.poll, say)
            proc.poll()
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))


def stop_group(proc: subprocess.Popen[Any], grace: float = 5.0, kill_wait: float = 5.0) -> int:
    """End ``proc`` and its process group whatever their state; the leader's exit code.

    SIGTERM to the group; if the leader has not exited within ``grace`` seconds, SIGKILL
    to the group. Once the leader has exited, whatever is left of the group (children
    that ignored SIGTERM or outlived it) gets SIGKILL, and the leader is reaped. Safe to
    call twice; ``grace=0`` kills at once.
    """
    if proc.returncode is not None:
        return proc.returncode
    if not (grace > 0 and signal_group(proc, signal.SIGTERM) and _exited(proc, grace)):
        signal_group(proc, signal.SIGKILL)
        _exited(proc, kill_wait)
    signal_group(proc, signal.SIGKILL)  # the leader is gone but not reaped: its group's id holds
    return proc.wait(timeout=kill_wait)


class ServerProcess:
    """``kvroute COMMAND ARGS`` in a child process with its own process group."""

    def __init__(
        self,
        command: str,
        args: Sequence[str],
        timeout: float = 60.0,
        checkout: str | os.PathLike[str] | None = None,
    ) -> None:
        """Start ``kvroute COMMAND ARGS`` on 127.0.0.1 and wait for its start-up line.
        ``checkout``: run the ``router`` package of that directory (another commit's
        worktree, its compiled helper built) instead of this one."""
        self.args = [sys.executable, "-m", "router", command, "--host", "127.0.0.1", *args]
        # A file, not a pipe: nobody reads stderr while the engine runs, and a full pipe
        # would block it.
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = start_group(
            self.args, stdout=subprocess.PIPE, stderr=self.stderr, text=True, cwd=checkout
        )
        self.line = ""
        try:
            self.line = self._read_line(timeout)
        except BaseException:
            self.stop()
            raise
        match = LISTENING.search(self.line)
        if match is None:
            self.stop()
            raise RuntimeError(f"unexpected start-up line: {self.line!r}")
        self.url = match.group(1)

    def _read_line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if sel.select(timeout=deadline - time.monotonic()):
                    line = self.proc.stdout.readline()
                    if line:
                        return line.strip()
                    self.proc.wait(timeout=5)
                    self.stderr.seek(0)
                    raise RuntimeError(f"server exited before listening: {self.stderr.read()}")
        raise TimeoutError(f"server did not print its address within {timeout} s")

    def terminate(self) -> int:
        """SIGTERM the server and wait for its exit code."""
        signal_group(self.proc, signal.SIGTERM)
        return self.proc.wait(timeout=10)

    def stop(self) -> None:
        """End the process group whatever its state (safe to call twice)."""
        stop_group(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.stderr.close()


class EngineProcess(ServerProcess):
    """``kvroute engine ARGS`` in its own process group."""

    def __init__(self, args: Sequence[str], timeout: float = 60.0) -> None:
        super().__init__("engine", args, timeout)
