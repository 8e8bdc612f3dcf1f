"""The engine emulator: a vLLM-compatible HTTP server around the engine model.

In-process use (tests, demos)::

    from router.emulator import EmulatorConfig, start_engine

    engine = await start_engine(EmulatorConfig(port=0, time_scale=0.01))
    ...
    await engine.stop()
"""

from router.emulator.config import EmulatorConfig
from router.emulator.faults import Faults
from router.emulator.server import EmulatedEngine, start_engine

__all__ = ["EmulatedEngine", "EmulatorConfig", "Faults", "start_engine"]
