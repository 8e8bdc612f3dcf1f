"""Calls to any healthy engine of a model's pool, for the tokenizers.

Settling a pool's tokenizer asks one of its engines what it serves and how it tokenizes
(:mod:`router.tokenization.pools`); which engine answers does not matter, so the calls
rotate over the healthy ones. None is on the request path unless ``tokenizer.mode`` is
``engine``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.fleet.registry import EngineState
from router.proxy import UpstreamError
from router.tokenization.base import TokenizerUnavailable

if TYPE_CHECKING:
    from router.fleet.registry import Registry
    from router.live_config import LiveConfig
    from router.proxy import Upstream


class PoolClient:
    """Requests to a healthy engine serving a model, rotating among them."""

    def __init__(self, live: LiveConfig, registry: Registry) -> None:
        self.live = live
        self.registry = registry
        self.upstream: Upstream | None = None
        """The client to engines, once the router has started."""
        self._turn = 0

    async def post(self, model: str, path: str, body: bytes) -> tuple[int, bytes]:
        """POST to a healthy engine serving ``model`` (rotating), for tokenization."""
        return await self._call(model, "POST", path, body)

    async def get(self, model: str, path: str) -> tuple[int, bytes]:
        """GET from a healthy engine serving ``model`` (what it serves, for the tokenizer)."""
        return await self._call(model, "GET", path, b"")

    async def _call(self, model: str, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        engines = [e for e in self.registry if model in e.models and e.state is EngineState.HEALTHY]
        if not engines or self.upstream is None:
            raise TokenizerUnavailable(f"no healthy engine serves {model!r}")
        self._turn += 1
        engine = engines[self._turn % len(engines)]
        try:
            return await self.upstream.call(
                method, engine.url + path, body, self.live.current.health.timeout_s * 2
            )
        except UpstreamError as exc:
            raise TokenizerUnavailable(str(exc)) from None
