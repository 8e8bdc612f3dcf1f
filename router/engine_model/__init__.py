"""The engine model: a pure, clocked vLLM-style engine (block cache, scheduler, timing).

Drivers: the real-time emulator (``router.emulator``) and the cluster simulator.
"""

from router.engine_model.block_cache import BlockCache
from router.engine_model.engine import (
    EngineModel,
    EngineStats,
    RequestOutput,
    RequestSpec,
    StepResult,
)
from router.engine_model.holds import HandoffError, HeldKV, HoldTable
from router.engine_model.params import DEFAULT_PRESET, PRESETS, EngineParams, preset
from router.engine_model.sampling import output_token_ids

__all__ = [
    "DEFAULT_PRESET",
    "PRESETS",
    "BlockCache",
    "EngineModel",
    "EngineParams",
    "EngineStats",
    "HandoffError",
    "HeldKV",
    "HoldTable",
    "RequestOutput",
    "RequestSpec",
    "StepResult",
    "output_token_ids",
    "preset",
]
