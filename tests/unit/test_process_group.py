"""router.process's process-group helper: a child in its own group, ended with SIGTERM,
a grace period, then SIGKILL, and everything it started ended with it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from router.process import signal_group, start_group, stop_group

#: Python that ignores SIGTERM, says so, and sleeps.
IGNORE_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "


def started(code: str) -> tuple[subprocess.Popen[str], list[str]]:
    """``python -c code`` in its own group, once it printed its first line (its words)."""
    proc = start_group([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    words = proc.stdout.readline().split()
    assert words, "the child printed nothing"
    return proc, words


def gone(pid: int, timeout: float = 20.0) -> bool:
    """Whether ``pid`` ends (or is left a zombie for its new parent) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return True
        if "\nState:\tZ" in status:
            return True
        time.sleep(0.05)
    return False


def test_a_child_in_its_own_group_is_its_group_leader() -> None:
    proc, words = started(
        "import os, time; print(os.getpgid(0), os.getsid(0), flush=True); time.sleep(60)"
    )
    try:
        assert words == [str(proc.pid), str(proc.pid)]
    finally:
        stop_group(proc, grace=1.0)


def test_a_child_that_exits_on_sigterm_ends_within_the_grace() -> None:
    proc, _ = started("import time; print('ready', flush=True); time.sleep(60)")
    assert stop_group(proc, grace=30.0) == -signal.SIGTERM


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    proc, _ = started(IGNORE_TERM + "print('ready', flush=True); time.sleep(60)")
    began = time.monotonic()
    assert stop_group(proc, grace=0.5) == -signal.SIGKILL
    assert time.monotonic() - began >= 0.5  # it had its grace first
    assert proc.returncode == -signal.SIGKILL  # reaped


def test_a_stopped_child_that_handles_sigterm_acts_on_it_within_the_grace() -> None:
    """A frozen child (SIGSTOP) that handles SIGTERM, as a server draining on it does,
    runs its handler only once continued: it is not left to sit out the grace."""
    on_term = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(3)); "
    proc, _ = started(on_term + "print('ready', flush=True); time.sleep(60)")
    assert signal_group(proc, signal.SIGSTOP)
    began = time.monotonic()
    assert stop_group(proc, grace=30.0) == 3  # its handler's exit, not a SIGKILL
    assert time.monotonic() - began < 15


def test_a_grandchild_ends_with_its_parent() -> None:
    spawn = (
        "import subprocess, sys, time; "
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(g.pid, flush=True); time.sleep(60)"
    )
    proc, words = started(spawn)
    grandchild = int(words[0])
    stop_group(proc, grace=10.0)
    assert proc.returncode is not None
    assert gone(grandchild)


def test_a_grandchild_that_ignores_sigterm_is_killed_once_its_parent_exits() -> None:
    stubborn = IGNORE_TERM + "print('ready', flush=True); time.sleep(60)"
    spawn = (
        "import subprocess, sys, time; "
        f"g = subprocess.Popen([sys.executable, '-c', {stubborn!r}]); "
        "print(g.pid, flush=True); time.sleep(60)"
    )
    proc, words = started(spawn)
    grandchild = int(words[0])
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"  # its handler is in place
    assert stop_group(proc, grace=10.0) == -signal.SIGTERM  # the parent went on SIGTERM
    assert gone(grandchild)


def test_stopping_twice_or_after_exit_is_harmless() -> None:
    proc, _ = started("print('bye', flush=True)")
    proc.wait(timeout=20)
    assert stop_group(proc) == 0
    assert stop_group(proc) == 0
    assert not signal_group(proc, signal.SIGTERM)  # reaped: its group id is not ours
