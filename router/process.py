"""Run a kvroute server (``kvroute engine``, ``kvroute serve``, ...) as a child process.

Used by the demo, the benchmarks and tests. The child runs in its own process group
(its own session), so ``stop()`` ends it and anything it started, and never the caller.
Every kvroute server prints one line containing ``listening on http://HOST:PORT`` once
it is ready; that line gives the address.
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
from collections.abc import Sequence

#: Every kvroute server prints one line with this when it is ready.
LISTENING = re.compile(r"listening on (http://\S+)")


class ServerProcess:
    """``kvroute COMMAND ARGS`` in a child process with its own process group."""

    def __init__(self, command: str, args: Sequence[str], timeout: float = 20.0) -> None:
        """Start ``kvroute COMMAND ARGS`` on 127.0.0.1 and wait for its start-up line."""
        self.args = [sys.executable, "-m", "router", command, "--host", "127.0.0.1", *args]
        # A file, not a pipe: nobody reads stderr while the engine runs, and a full pipe
        # would block it.
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            start_new_session=True,
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
        os.killpg(self.proc.pid, signal.SIGTERM)
        return self.proc.wait(timeout=10)

    def stop(self) -> None:
        """End the process group whatever its state (safe to call twice)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
            except ProcessLookupError:
                pass
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.stderr.close()


class EngineProcess(ServerProcess):
    """``kvroute engine ARGS`` in its own process group."""

    def __init__(self, args: Sequence[str], timeout: float = 20.0) -> None:
        super().__init__("engine", args, timeout)
