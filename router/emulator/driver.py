"""Runs an ``EngineModel`` in real time inside the server's event loop.

Model time maps to wall time as ``wall = t0 + model x time_scale``. While there is work,
steps run back to back in model time (each starts where the previous one ended) and
the driver sleeps until each step's end in wall time. When the loop falls behind (timer
granularity, a busy CPU), it skips sleeping until it has caught up, so model timestamps
stay exact and only delivery is late. While idle, model time follows the wall clock, so
a request's arrival is its wall arrival. When nothing can run but the model has a timed
event pending (a KV transfer ending, a held block expiring), the driver sleeps until it
and starts from exactly that model time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from router.engine_model import EngineModel, HeldKV, RequestOutput, RequestSpec
from router.events.types import KVEvent

log = logging.getLogger(__name__)

#: Where a request's outputs go: the queue of its HTTP handler and the choice index.
Sink = tuple["asyncio.Queue[tuple[int, RequestOutput]]", int]
EventSink = Callable[[Sequence[KVEvent], float], None]


class EngineDriver:
    """The real-time clock, step loop and output fan-out of one engine rank."""

    def __init__(
        self,
        model: EngineModel,
        time_scale: float,
        on_events: EventSink | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> None:
        self.model = model
        self.time_scale = time_scale
        self._on_events = on_events
        self._on_output = on_output
        self._sinks: dict[str, Sink] = {}
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self._model_now = 0.0
        self._step_end: float | None = None
        #: Model time of the first submission since the last step started.
        self._arrival: float | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def now(self) -> float:
        """Current model time.

        Idle, it follows the wall clock. During a step it is the wall clock clamped to
        the step's model interval, so an arrival is never later than the step end at
        which it can first be scheduled, even when delivery runs late.
        """
        wall = (self._loop.time() - self._t0) / self.time_scale
        if self._step_end is not None:
            return min(max(wall, self._model_now), self._step_end)
        return max(self._model_now, wall)

    def start(self) -> None:
        if self._task is None:
            self._task = self._loop.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def submit(self, spec: RequestSpec, sink: Sink) -> None:
        """Queue a request; its outputs are put on ``sink`` as ``(index, output)``."""
        now = self.now()
        self.model.submit(spec, now)
        self._sinks[spec.request_id] = sink
        self._poke(now)

    def abort(self, request_id: str) -> bool:
        """Forget a request (client gone): frees its blocks at once.

        Returns whether the request was still unfinished in the engine.
        """
        if self._sinks.pop(request_id, None) is None:
            return False
        aborted = self.model.abort(request_id, self.now())
        self._poke(self.now())
        return aborted

    def claim_hold(self, request_id: str, block_ids: Sequence[int] | None) -> HeldKV:
        """A remote decode engine starts reading a held request's blocks now."""
        return self.model.claim_hold(request_id, block_ids, self.now())

    def peek_hold(self, request_id: str) -> HeldKV | None:
        """What a held request holds now, without claiming it."""
        return self.model.peek_hold(request_id, self.now())

    def release_hold(self, request_id: str) -> bool:
        """Free a held request's blocks now; waiting requests may fit again."""
        released = self.model.release_hold(request_id, self.now())
        self._poke(self.now())
        return released

    def _poke(self, now: float) -> None:
        """Something changed at model time ``now``: let the step loop look again."""
        if self._arrival is None:
            self._arrival = now
        self._wake.set()

    def reset_prefix_cache(self) -> bool:
        ok = self.model.reset_prefix_cache(self.now())
        self._publish(self.model.take_events())
        return ok

    def _publish(self, events: Sequence[KVEvent]) -> None:
        if events and self._on_events is not None:
            self._on_events(events, time.time())

    async def _run(self) -> None:
        try:
            await self._loop_steps()
        except Exception:
            log.exception("engine driver stopped on an error; requests will not progress")
            raise

    async def _idle(self) -> float:
        """Wait until an arrival or the model's next timed event; return its model time.

        An idle engine starts at once on an arrival: the wall time this loop takes to
        wake up must not count (it is magnified by ``1 / time_scale``). For the same
        reason a timed event starts at its own model time, not at the wake-up's.
        """
        while self._arrival is None:
            wakeup = self.model.next_wakeup()
            self._wake.clear()
            if wakeup is None:
                await self._wake.wait()
                continue
            delay = self._t0 + wakeup * self.time_scale - self._loop.time()
            if delay > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                    continue
            return max(wakeup, self._model_now)
        return max(self._arrival, self._model_now)

    async def _loop_steps(self) -> None:
        loop = self._loop
        model = self.model
        start: float | None = None
        while True:
            if start is None:
                start = await self._idle()
            self._arrival = None
            duration = model.start_step(start)
            if duration is None:
                # Nothing can run now (no work, none that fits, or only transfers in
                # flight); admissions may still have evicted blocks.
                self._publish(model.take_events())
                start = None
                continue
            end = start + duration
            self._model_now, self._step_end = start, end
            delay = self._t0 + end * self.time_scale - loop.time()
            # Sleeping 0 still yields, so HTTP handlers run between back-to-back steps.
            await asyncio.sleep(delay if delay > 0 else 0)
            self._model_now, self._step_end = end, None
            result = model.finish_step(end)
            self._publish(result.events)
            sinks = self._sinks
            for out in result.outputs:
                sink = sinks.pop(out.request_id) if out.finished else sinks.get(out.request_id)
                if sink is not None:
                    sink[0].put_nowait((sink[1], out))
                if self._on_output is not None:
                    self._on_output(out)
            # Back to back while there is work: the next step starts where this one ended.
            start = end if model.has_work else None
