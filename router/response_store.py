"""Which engine holds each stored Responses API response.

vLLM keeps a stored response (``store``, its default) in the memory of the engine that
produced it: ``previous_response_id``, ``GET /v1/responses/{id}`` and ``/cancel`` work
only there. The router learns each response's id from the engine's answer and
remembers its engine's endpoint for ``responses.ttl_s``: in this process (at most
``responses.max_remembered`` ids, the oldest forgotten first) and, when the index is
shared in Redis, under the index's namespace (``{ns}:response:<id>``,
docs/redis-schema.md), so another replica finds it. Redis being away only narrows the
memory to this replica's own answers.
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from router.index.base import IndexUnavailable
from router.redis.response_engines import ResponseEngines

if TYPE_CHECKING:
    from router.config import ResponsesConfig
    from router.redis.client import RedisClient

log = logging.getLogger("kvroute.responses")

RESPONSE_ID = re.compile(r"[A-Za-z0-9_.:-]{1,256}")
"""What a response id may look like (vLLM's are ``resp_<hex>``); it becomes part of a
Redis key and of the engine URL a ``GET`` goes to, so nothing else is remembered."""

#: The least time an answer waits for its id to reach Redis (a next turn may go to
#: another replica as soon as the client has the id).
MIN_WRITE_S = 0.1


class ResponseStore:
    """Response id -> the endpoint (``host:port``) of the engine that holds it."""

    def __init__(
        self,
        config: ResponsesConfig,
        redis: RedisClient | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.shared = ResponseEngines(redis) if redis is not None else None
        """Where other replicas find the ids this one remembers (None: this replica's
        memory alone)."""
        self.clock = clock
        self._held: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    async def remember(self, response_id: str, endpoint: str) -> None:
        """Record that ``endpoint`` holds ``response_id`` (here, then in Redis)."""
        if not RESPONSE_ID.fullmatch(response_id):
            return
        ttl = self.config.ttl_s
        self._held[response_id] = (endpoint, self.clock() + ttl)
        self._held.move_to_end(response_id)
        while len(self._held) > self.config.max_remembered:
            self._held.popitem(last=False)
        if self.shared is not None:
            try:
                await self.shared.remember(
                    response_id,
                    endpoint,
                    int(ttl * 1000),
                    max(self.shared.redis.budget, MIN_WRITE_S),
                )
            except IndexUnavailable as exc:
                log.info("response %s: not shared with other replicas (%s)", response_id, exc)

    async def engine_of(self, response_id: str) -> str | None:
        """The endpoint holding ``response_id``; None when unknown or expired."""
        if not RESPONSE_ID.fullmatch(response_id):
            return None
        held = self._held.get(response_id)
        if held is not None:
            endpoint, expires = held
            if expires > self.clock():
                return endpoint
            del self._held[response_id]
        if self.shared is None:
            return None
        try:
            return await self.shared.engine_of(response_id)
        except IndexUnavailable as exc:
            log.info("response %s: Redis not asked (%s)", response_id, exc)
            return None
