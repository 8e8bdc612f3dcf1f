"""Child processes in their own process group, and kvroute servers run that way.

:func:`start_group` starts a command in its own session (so its own process group),
:func:`signal_group` signals that group, and :func:`stop_group` ends it: SIGTERM, a
grace period, SIGKILL, then the leader is reaped. Signals go to the group, so whatever
the child started ends with it, and never the caller. The demo, the benchmarks, the
peer-router comparison and the tests' Envoy and vLLM helpers all use these three.

:class:`ServerProcess` runs a kvroute server (``kvroute engine``, ``kvroute serve``,
...) that way. Every kvroute server prints one line containing
``listening on http://HOST:PORT`` once it is ready; that line gives the address, and
:meth:`ServerProcess.read_line` waits, within a deadline, for the lines after it.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
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
    call twice; ``grace=0`` kills at once. A stopped group (SIGSTOP: a frozen Redis, a
    paused engine) is continued after the SIGTERM: a process that handles SIGTERM runs
    its handler only once continued, and would otherwise sit out the grace.
    """
    if proc.returncode is not None:
        return proc.returncode
    terminated = grace > 0 and signal_group(proc, signal.SIGTERM)
    if terminated:
        signal_group(proc, signal.SIGCONT)
    if not (terminated and _exited(proc, grace)):
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
        # Stdout is read by a thread of its own: a caller waits for the next line with a
        # deadline (a blocking readline has none, and a thread blocked in one holds up
        # the exit of an event loop's default executor), and the pipe never fills.
        self._lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._ended = False
        self._reader = threading.Thread(
            target=self._read_stdout, name=f"kvroute {command} stdout", daemon=True
        )
        self._reader.start()
        self.line = ""
        try:
            self.line = self._first_line(timeout)
        except BaseException:
            self.stop()
            raise
        match = LISTENING.search(self.line)
        if match is None:
            self.stop()
            raise RuntimeError(f"unexpected start-up line: {self.line!r}")
        self.url = match.group(1)

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                self._lines.put(line)
        except (OSError, ValueError):  # the pipe closed under the read
            pass
        finally:
            self._lines.put("")

    def read_line(self, timeout: float) -> str:
        """The next line the server printed on stdout (with its newline), or ``""``
        once its output has ended; :class:`TimeoutError` if neither came within
        ``timeout`` seconds."""
        if self._ended:
            return ""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the server printed no line within {timeout} s") from None
        self._ended = not line
        return line

    def _first_line(self, timeout: float) -> str:
        try:
            line = self.read_line(timeout)
        except TimeoutError:
            raise TimeoutError(f"server did not print its address within {timeout} s") from None
        if not line:
            self.proc.wait(timeout=5)
            self.stderr.seek(0)
            raise RuntimeError(f"server exited before listening: {self.stderr.read()}")
        return line.strip()

    def terminate(self) -> int:
        """SIGTERM the server and wait for its exit code."""
        signal_group(self.proc, signal.SIGTERM)
        return self.proc.wait(timeout=10)

    def stop(self) -> None:
        """End the process group whatever its state (safe to call twice)."""
        stop_group(self.proc)
        # With the group gone the pipe has ended and the reader with it; one held open by
        # a process that left the group is left to the reader (closing the pipe under a
        # blocked read would wait for that read).
        self._reader.join(timeout=5)
        if self.proc.stdout is not None and not self._reader.is_alive():
            self.proc.stdout.close()
        self.stderr.close()


class EngineProcess(ServerProcess):
    """``kvroute engine ARGS`` in its own process group."""

    def __init__(self, args: Sequence[str], timeout: float = 60.0) -> None:
        super().__init__("engine", args, timeout)
