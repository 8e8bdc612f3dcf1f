"""Each model pool's KV block size, and what disagrees with it.

A pool's block size is configured (``block_size``, ``models[].block_size``), else taken
from the first of its engines that reports one (``/server_info``), else the default. An
engine that reports another is refused: its KV events would name other blocks than the
router's keys. An event batch in another block size is dropped (and counted by the
ingestor), and logged once per stream.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.config import Config
    from router.fleet.load import LoadTracker
    from router.fleet.registry import Engine, Registry
    from router.live_config import LiveConfig
    from router.types import EngineKey

log = logging.getLogger("kvroute")


class BlockSizes:
    """The KV block size of every model's pool, adopted from its engines where not
    configured."""

    def __init__(self, live: LiveConfig, registry: Registry, loads: LoadTracker) -> None:
        self.live = live
        self.registry = registry
        self.loads = loads
        self.adopted: dict[str, int] = {}
        """Block sizes pools without a configured one took from their first engine."""
        self._mismatch_warned: set[EngineKey] = set()
        """Streams whose block-size mismatch was logged: one line each, not one per event."""

    @property
    def config(self) -> Config:
        return self.live.current

    def of(self, model: str) -> int:
        """The KV block size of a (base) model's pool: configured, else adopted from the
        pool's engines, else the default."""
        if not self.config.block_size_configured(model):
            adopted = self.adopted.get(model)
            if adopted is not None:
                return adopted
        return self.config.model_settings(model)[1]

    def adopt(self, model: str, block_size: int) -> None:
        """A pool without a configured block size takes its first engine's."""
        if self.config.block_size_configured(model) or model in self.adopted:
            return
        self.adopted[model] = block_size
        if block_size != self.config.block_size:
            log.info(
                "model %r: KV block size %d, as its engines report (no block_size configured)",
                model,
                block_size,
            )
        self.loads.block_size = block_size

    def fits(self, engine: Engine) -> bool:
        """Whether an engine's block size is its pools' (adopting it where a pool has
        none yet); an engine that does not fit is refused in the registry."""
        if engine.block_size is None:
            return True
        for model in self.registry.base_models(engine):
            self.adopt(model, engine.block_size)
            pool = self.of(model)
            if engine.block_size != pool:
                reason = (
                    f"engine {engine.url} uses KV block size {engine.block_size} but the "
                    f"pool of model {model!r} uses {pool}; set --block-size (or "
                    f"models[].block_size) to match, or fix the engine"
                )
                log.error("refusing %s", reason)
                self.registry.refuse(engine, reason)
                return False
        return True

    def event_mismatch(self, key: EngineKey, expected: int, got: int) -> None:
        """An event used another block size than the engine's: it is dropped and counted
        (``kvroute_kv_events_block_size_mismatch_total``), and the engine stays. Events
        are not authenticated (in bind mode any publisher may name any engine), so only
        the engine's own reports (/server_info, /metrics) may refuse it."""
        if key in self._mismatch_warned:
            return
        self._mismatch_warned.add(key)
        log.warning(
            "KV events of %s use block size %d, not the engine's %d: dropped (if the "
            "engine does use %d, set --block-size or models[].block_size to match)",
            key.label,
            got,
            expected,
            got,
        )
