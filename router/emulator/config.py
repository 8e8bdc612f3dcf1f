"""Settings of one emulated engine server: identity, network endpoints and the model."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Literal

from router.engine_model import EngineParams
from router.events.vllm import WIRE_FORMATS, WireFormat

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")

DEFAULT_MODEL = "kvroute-emulated"


@dataclass(frozen=True)
class EmulatorConfig:
    """Everything ``kvroute engine`` takes, validated on construction.

    ``hash_seed`` roots the engine's block hashes; None draws a random one at start-up,
    like vLLM, so that routers cannot rely on an engine's hash values.
    """

    model: str = DEFAULT_MODEL
    host: str = "127.0.0.1"
    port: int = 0
    engine_id: str = field(default_factory=lambda: f"emu-{secrets.token_hex(4)}")
    role: Role = "both"
    params: EngineParams = field(default_factory=EngineParams)
    hash_seed: int | None = None
    time_scale: float = 1.0
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str | None = None
    kv_events_format: WireFormat = "v3-map"
    lora_modules: tuple[str, ...] = ()
    default_max_tokens: int = 16

    def __post_init__(self) -> None:
        if not self.model or any(c.isspace() for c in self.model):
            raise ValueError(f"model must be a non-empty name without spaces, got {self.model!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be positive, got {self.time_scale}")
        if self.kv_events_format not in WIRE_FORMATS:
            raise ValueError(
                f"kv_events_format must be one of {', '.join(WIRE_FORMATS)}, "
                f"got {self.kv_events_format!r}"
            )
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be positive, got {self.default_max_tokens}")
        if self.model in self.lora_modules or len(set(self.lora_modules)) != len(self.lora_modules):
            raise ValueError("lora_modules must be distinct and differ from the model name")
