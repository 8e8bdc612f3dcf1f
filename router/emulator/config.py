"""Settings of one emulated engine server: identity, network endpoints, handoffs, faults."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Literal

from router.emulator.faults import Faults
from router.emulator.kv_publisher import REPLAY_BUFFER, binds
from router.engine_model import EngineParams
from router.events.vllm import (
    EVENT_FORMATS,
    REPLAY_FRAMES,
    VLLM_WIRE_FORMAT,
    EventFormat,
    ReplayFrames,
)
from router.media import DEFAULT_MM_PLACEHOLDER_TOKENS

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
#: What a NIXL decode leg does when its ``kv_transfer_params`` cannot be used.
HandoffFailure = Literal["recompute", "error"]
HANDOFF_FAILURES: tuple[HandoffFailure, ...] = ("recompute", "error")

DEFAULT_MODEL = "kvroute-emulated"


@dataclass(frozen=True)
class EmulatorConfig:
    """Everything ``kvroute engine`` takes, validated on construction.

    ``hash_seed`` roots the engine's block hashes; None draws a random one at start-up,
    like vLLM, so that routers cannot rely on an engine's hash values.

    ``side_channel_host`` (default: ``host``) and ``side_channel_port`` are where NIXL
    decode legs pull KV from (rank r listens on port + r; port 0: free ports). The
    SGLang bootstrap listener (``bootstrap_port``, 0: a free one) runs only with role
    ``prefill``. ``bootstrap_timeout_s`` is wall time: it bounds how long one leg of an
    SGLang pair waits for the other to arrive, a network matter, not modelled work.
    ``faults`` are the faults in force at start-up.
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
    kv_events_format: EventFormat = VLLM_WIRE_FORMAT
    kv_events_replay_frames: ReplayFrames = "topic"
    """Replay reply frames: vLLM 0.32's (``topic``) or older releases' (``legacy``)."""
    kv_events_buffer_steps: int = REPLAY_BUFFER
    """Batches kept for replay (vLLM's ``buffer_steps``)."""
    kv_events_curve_key: str | None = None
    """The publisher's CURVE key (a ``NAME.key_secret`` certificate), with
    ``kv_events_curve_server_key``: for a router whose bound socket asks for CURVE."""
    kv_events_curve_server_key: str | None = None
    """The router's public CURVE key (its ``NAME.key`` certificate)."""
    lora_modules: tuple[str, ...] = ()
    default_max_tokens: int = 16
    mm_placeholder_tokens: int = DEFAULT_MM_PLACEHOLDER_TOKENS
    """Placeholder tokens each image, audio or video part of a chat takes in the prompt."""
    dp_size: int = 1
    side_channel_host: str | None = None
    side_channel_port: int = 0
    bootstrap_port: int = 0
    bootstrap_timeout_s: float = 300.0
    handoff_failure: HandoffFailure = "recompute"
    faults: Faults = field(default_factory=Faults)
    tls_cert_file: str | None = None
    """Serve HTTPS with this PEM certificate chain (and ``tls_key_file``)."""
    tls_key_file: str | None = None
    api_key: str | None = None
    """Like vLLM's ``--api-key``: /v1/* answers 401 without ``Bearer api_key``."""

    def __post_init__(self) -> None:
        if not self.model or any(c.isspace() for c in self.model):
            raise ValueError(f"model must be a non-empty name without spaces, got {self.model!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be positive, got {self.time_scale}")
        if self.kv_events_format not in EVENT_FORMATS:
            raise ValueError(
                f"kv_events_format must be one of {', '.join(EVENT_FORMATS)}, "
                f"got {self.kv_events_format!r}"
            )
        if self.kv_events_replay_frames not in REPLAY_FRAMES:
            raise ValueError(
                f"kv_events_replay_frames must be one of {', '.join(REPLAY_FRAMES)}, "
                f"got {self.kv_events_replay_frames!r}"
            )
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        if (self.kv_events_curve_key is None) != (self.kv_events_curve_server_key is None):
            raise ValueError("kv_events_curve_key and kv_events_curve_server_key go together")
        if self.kv_events_curve_key is not None and (
            not self.kv_events_endpoint or binds(self.kv_events_endpoint)
        ):
            raise ValueError(
                "CURVE keys are for a kv_events_endpoint the engine connects to (a router's "
                "bound socket), not one it binds"
            )
        if self.kv_events_buffer_steps < 1:
            raise ValueError(
                f"kv_events_buffer_steps must be positive, got {self.kv_events_buffer_steps}"
            )
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be positive, got {self.default_max_tokens}")
        if self.model in self.lora_modules or len(set(self.lora_modules)) != len(self.lora_modules):
            raise ValueError("lora_modules must be distinct and differ from the model name")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be at least 1, got {self.dp_size}")
        if self.mm_placeholder_tokens < 1:
            raise ValueError(
                f"mm_placeholder_tokens must be at least 1, got {self.mm_placeholder_tokens}"
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        for name in ("side_channel_port", "bootstrap_port"):
            port = getattr(self, name)
            if not 0 <= port < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        if self.side_channel_port and self.side_channel_port + self.dp_size > 65536:
            raise ValueError("side_channel_port + dp_size exceeds 65535")
        if not self.bootstrap_timeout_s > 0:
            raise ValueError(
                f"bootstrap_timeout_s must be positive, got {self.bootstrap_timeout_s}"
            )
        if self.handoff_failure not in HANDOFF_FAILURES:
            raise ValueError(
                f"handoff_failure must be one of {', '.join(HANDOFF_FAILURES)}, "
                f"got {self.handoff_failure!r}"
            )

    @property
    def kv_host(self) -> str:
        """The host NIXL side channels listen on and report in ``kv_transfer_params``."""
        return self.side_channel_host or self.host
