"""What the HTTP handlers of one emulated engine server share: settings, ranks, faults."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from router.emulator.config import EmulatorConfig
from router.emulator.driver import EngineDriver
from router.emulator.faults import Faults
from router.emulator.handoff.sglang import RoomRegistry
from router.emulator.metrics import EngineMetrics, RankMetrics
from router.emulator.protocol import APIError, GenerationRequest, ServedModels, parse_generation
from router.tokenization.words import WordTokenizer

#: vLLM's request header selecting a data-parallel rank.
DP_RANK_HEADER = "x-data-parallel-rank"


@dataclass
class Rank:
    """One data-parallel rank: its own engine model, clock, events and side channel."""

    index: int
    driver: EngineDriver
    metrics: RankMetrics
    #: The engine id NIXL handoffs name (``<engine_id>_dp<rank>`` with several ranks).
    kv_engine_id: str
    #: Where this rank's side channel listens (set once bound).
    side_channel_port: int = 0


@dataclass
class EmulatorState:
    """Settings, the engine ranks, what was bound, and the faults in force."""

    config: EmulatorConfig
    ranks: list[Rank]
    metrics: EngineMetrics
    #: ``/server_info`` body, filled in once the sockets are bound.
    server_info: dict[str, Any]
    faults: Faults
    #: ``/kv_event_sources`` body (vLLM 0.32's route): one entry per rank.
    kv_event_sources: dict[str, Any] = field(default_factory=dict)
    #: SGLang bootstrap rooms (role ``prefill`` only).
    rooms: RoomRegistry | None = None
    tokenizer: WordTokenizer = field(default_factory=WordTokenizer)
    created: int = field(default_factory=lambda: int(time.time()))
    serial: itertools.count[int] = field(default_factory=itertools.count)
    models: ServedModels = field(init=False)
    rng: random.Random = field(default_factory=random.Random)
    _next_rank: itertools.count[int] = field(default_factory=itertools.count)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        cfg = self.config
        self.models = ServedModels(cfg.model, {n: i + 1 for i, n in enumerate(cfg.lora_modules)})

    @property
    def drivers(self) -> list[EngineDriver]:
        """Every rank's driver, by rank."""
        return [rank.driver for rank in self.ranks]

    def parse(self, body: dict[str, Any], chat: bool) -> GenerationRequest:
        """Validate a generation body, including that each prompt fits the engine."""
        req = parse_generation(
            body,
            chat,
            self.models,
            self.tokenizer,
            self.config.default_max_tokens,
            self.config.mm_placeholder_tokens,
        )
        model = self.ranks[0].driver.model
        for ids in req.prompts:
            try:
                model.validate(len(ids), req.max_tokens)
            except ValueError as exc:
                raise APIError(400, str(exc), "messages" if chat else "prompt") from None
        return req

    def pick_rank(self, headers: Mapping[str, str], body: Mapping[str, Any] | None = None) -> Rank:
        """The rank ``X-data-parallel-rank`` names (400 if out of range), else the next
        one round robin. Emulating SGLang (``--kv-events-format sglang``), the body's
        ``data_parallel_rank`` names it instead and the header is ignored, as SGLang's
        server does."""
        size = len(self.ranks)
        if self.config.kv_events_format == "sglang":
            field = (body or {}).get("data_parallel_rank")
            if field is None:
                return self.ranks[next(self._next_rank) % size]
            if isinstance(field, bool) or not isinstance(field, int) or not 0 <= field < size:
                raise APIError(400, f"data_parallel_rank {field!r} is out of range [0, {size}).")
            return self.ranks[field]
        value = headers.get(DP_RANK_HEADER)
        if value is None:
            return self.ranks[next(self._next_rank) % size]
        try:
            index = int(value)
        except ValueError:
            raise APIError(400, f"X-data-parallel-rank must be an integer, got {value!r}") from None
        if not 0 <= index < size:
            raise APIError(400, f"data_parallel_rank {index} is out of range [0, {size}).")
        return self.ranks[index]

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background until it ends or the server stops."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop_background(self) -> None:
        """Cancel what ``spawn`` started and wait for it."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
