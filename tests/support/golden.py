"""Golden files: text a test produces, compared byte for byte with a file under
``tests/fixtures/golden/``, or written there when ``REGEN_GOLDEN=1``."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden"

#: The switch that rewrites the golden files instead of comparing with them. It carries
#: kvroute's configuration prefix, so a test that runs a command reading the environment
#: (``load_config``) removes it first: read here once, when the tests import this module.
REGEN_VARIABLE = "REGEN_GOLDEN"
REGENERATE = os.environ.get(REGEN_VARIABLE) == "1"


def check_golden(name: str, text: str) -> None:
    """Fail with a unified diff unless ``text`` is the golden file ``name`` byte for byte;
    with ``REGEN_GOLDEN=1``, write ``text`` there instead."""
    path = GOLDEN / name
    if REGENERATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode())
        return
    rerun = f"{REGEN_VARIABLE}=1 rewrites it, if the change is meant"
    if not path.exists():
        pytest.fail(f"no golden file {path}: {rerun}", pytrace=False)
    expected = path.read_bytes().decode()
    if text == expected:
        return
    diff = "".join(
        difflib.unified_diff(
            expected.splitlines(keepends=True),
            text.splitlines(keepends=True),
            fromfile=f"tests/fixtures/golden/{name}",
            tofile="this run",
        )
    )
    pytest.fail(
        f"this run differs from tests/fixtures/golden/{name} ({rerun}):\n{diff}", pytrace=False
    )
