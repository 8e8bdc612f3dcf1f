"""Shared test fixtures.

Redis: one throw-away ``redis-server`` per test session (or ``REDIS_URL``, or a
container), and a fresh key namespace per test; see ``tests/support/redis.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.redis import delete_namespace, random_namespace, session_redis_url


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of the Redis the tests share; skips the test when none can be had."""
    with session_redis_url() as url:
        if url is None:
            pytest.skip("no Redis: put redis-server on the PATH, set REDIS_URL, or run Docker")
        yield url


@pytest.fixture
def redis_namespace(redis_url: str) -> Iterator[str]:
    """A key namespace of this test alone, deleted afterwards."""
    namespace = random_namespace()
    yield namespace
    delete_namespace(redis_url, namespace)
