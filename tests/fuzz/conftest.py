"""Time limits for the fuzz tests under ``make fuzz``.

The long hypothesis profile (3,000 examples a test) makes a property test that sends
each example over HTTP or gRPC run for minutes, more on a busy machine, past the
suite's 120 s per test. Under that profile a test without its own timeout marker gets
``FUZZ_TIMEOUT_S``; ``make test``'s bounded profile keeps the suite's limit.
"""

from __future__ import annotations

import os

import pytest

FUZZ_TIMEOUT_S = 1200


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.environ.get("HYPOTHESIS_PROFILE") != "fuzz":
        return
    for item in items:
        if "tests/fuzz/" in item.nodeid and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(FUZZ_TIMEOUT_S))
