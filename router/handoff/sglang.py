"""SGLang's bootstrap dialect (push): one pair chosen up front, both legs at once.

The router adds ``bootstrap_host`` and ``bootstrap_port`` (the prefill engine's
bootstrap listener) and ``bootstrap_room`` (a random 63-bit integer naming the pair) to
the same body, sends it to the prefill and the decode engine concurrently, returns the
decode engine's answer and discards the prefill's. If one leg fails, the other is
cancelled.

:class:`SGLangHandoff` drives the pair for the router. A failed prefill leg (or a pair
that stalled: the decode leg timed out waiting for the prefill's KV) is retried with
another prefill engine and a fresh room, both legs sent again, then the decode engine
serves alone (unless ``fallback_to_decode`` is off); the decode engine is not blamed
for it. The client sees the prefill leg's ``cached_tokens`` (SGLang's decode leg counts
the pushed KV as cached).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import msgspec

from router.handoff.base import PREFILL_TRIES, Directions, Handoff, Legs, prefill_saved
from router.policy.base import request_rng
from router.proxy import UpstreamError
from router.serving.charges import Charges
from router.serving.usage import UsageTap, carries_usage

if TYPE_CHECKING:
    from router.fleet.registry import Engine
    from router.plan import Plan
    from router.policy.base import Decision
    from router.serving.context import RequestContext
    from router.serving.downstream import Downstream

log = logging.getLogger("kvroute.pd")
_encode = msgspec.json.encode


def new_room(rng: random.Random) -> int:
    return rng.getrandbits(63)


def with_bootstrap(payload: Mapping[str, Any], host: str, port: int, room: int) -> dict[str, Any]:
    body = dict(payload)
    body["bootstrap_host"] = host
    body["bootstrap_port"] = port
    body["bootstrap_room"] = room
    return body


def prefill_only(payload: Mapping[str, Any]) -> dict[str, Any]:
    """An SGLang prefill leg needs no stream: its answer is discarded."""
    body = dict(payload)
    body["stream"] = False
    body.pop("stream_options", None)
    return body


class SGLangHandoff(Handoff):
    """Push: the pair's two legs at once, naming the prefill engine's bootstrap room."""

    name = "sglang"

    def directions(self, plan: Plan, prefill: Engine | None) -> Directions:
        out = super().directions(plan, prefill)
        out.pick["bootstrap_host"] = (urlsplit(prefill.url).hostname or "") if prefill else ""
        out.pick["bootstrap_port"] = (prefill.bootstrap_port or 0) if prefill else 0
        out.pick["bootstrap_room"] = new_room(request_rng(plan.route.request_id))
        return out

    async def serve(self, ctx: RequestContext, plan: Plan, legs: Legs) -> None:
        """Pairs of the decode engine with the planned prefill engine, then with one
        other, each with a fresh room; then the decode engine alone."""
        tried: set[str] = set()
        last: UpstreamError | None = None
        for attempt in range(PREFILL_TRIES):
            prefill = plan.prefill if attempt == 0 else await legs.another_prefill(ctx, plan, tried)
            if prefill is None:
                break
            try:
                return await self._pair(ctx, plan, legs, prefill)
            except _PrefillFailed as failed:
                last = failed.error
                tried.add(prefill.engine.endpoint)
                legs.metrics.retries.labels(last.kind).inc()
                log.info(
                    "request %s: SGLang prefill leg on %s failed (%s); decode engine %s not blamed",
                    ctx.request_id,
                    prefill.engine.label,
                    last,
                    plan.decode.engine.label,
                )
        return await self.fall_back(ctx, plan, legs, last)

    async def _pair(self, ctx: RequestContext, plan: Plan, legs: Legs, prefill: Decision) -> None:
        """Both legs of one pair at once; when one fails, the other is cancelled.

        Raises :class:`_PrefillFailed` when the prefill leg failed (the decode engine is
        not to blame; the caller tries another prefill engine), and UpstreamError when
        the decode leg failed before its first byte (the router tries another decode
        engine). A decode leg that times out while the prefill leg has not answered
        either counts as the prefill's failure: a decode engine cannot answer before the
        prefill engine pushes the KV. Once the decode leg has begun answering the client,
        a failing prefill leg no longer stops it (the KV has arrived).
        """
        decode = plan.decode
        engine = legs.engine(prefill.engine)
        assert engine is not None
        port = engine.bootstrap_port
        if port is None:
            raise _PrefillFailed(UpstreamError("protocol", f"{engine.url} has no bootstrap port"))
        host = urlsplit(engine.url).hostname or ""
        # a fresh room for every pair a request tries
        pair = f"{ctx.request_id}\x00{prefill.engine.label}\x00{decode.engine.label}"
        room = new_room(request_rng(pair))
        payload = ctx.payload
        prefill_task = asyncio.ensure_future(
            legs.prefill_leg(
                ctx, prefill, _encode(with_bootstrap(prefill_only(payload), host, port, room))
            )
        )
        # SGLang's decode leg counts the pushed KV as cached: show the prefill's count.
        watched = _Watched(ctx.sink, prefill_task, prefill)
        decode_task = asyncio.ensure_future(
            legs.decode_leg(
                ctx,
                decode,
                _encode(with_bootstrap(payload, host, port, room)),
                sink=watched,
                cached_tokens=Charges.of(plan).decode.cached_tokens,
                headers={"x-kvroute-mode": "split", "x-kvroute-prefill": prefill.engine.label},
            )
        )
        tasks = (prefill_task, decode_task)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if prefill_task.done() and not watched.answered:
                error = prefill_task.exception()
                if error is not None:  # the pair cannot complete: stop the decode leg
                    await _cancel(decode_task)
                    raise _PrefillFailed(error) if isinstance(error, UpstreamError) else error
                status, answer = prefill_task.result()
                if status >= 400:  # the engine refused the request: the client's error
                    await _cancel(decode_task)
                    return await legs.refused(ctx, status, answer)
            elif decode_task.done() and not prefill_task.done():
                error = decode_task.exception()
                if isinstance(error, UpstreamError) and error.kind == "timeout":
                    await _cancel(prefill_task)
                    raise _PrefillFailed(error)
            await decode_task
        except BaseException:
            for task in tasks:
                await _cancel(task)
            raise
        if ctx.outcome.outcome != "client_error":
            assert plan.split is not None
            legs.metrics.handoffs.labels("sglang", "pulled").inc()
            legs.metrics.transfer_bytes.inc(
                plan.split.uncached_tokens * legs.disaggregation.kv_bytes_per_token
            )
        await asyncio.gather(prefill_task, return_exceptions=True)  # its answer is discarded


class _PrefillFailed(Exception):
    """A pair failed on its prefill leg (``error`` says how)."""

    def __init__(self, error: UpstreamError) -> None:
        super().__init__(str(error))
        self.error = error


class _Watched:
    """The :class:`Downstream` of a decode leg: remembers whether anything reached the
    client, and shows the prefill leg's ``cached_tokens`` in the answer's usage
    (waiting for the prefill's answer, which the KV's arrival all but implies)."""

    __slots__ = ("answered", "prefill", "prefill_leg", "sink")

    def __init__(
        self,
        sink: Downstream,
        prefill_leg: asyncio.Future[tuple[int, dict[str, Any]]],
        prefill: Decision,
    ) -> None:
        self.sink = sink
        self.prefill_leg = prefill_leg
        self.prefill = prefill
        self.answered = False

    @property
    def headers(self) -> Any:
        return self.sink.headers

    async def _tap(self) -> UsageTap:
        await asyncio.wait((self.prefill_leg,))
        leg = self.prefill_leg
        answer = None
        if not leg.cancelled() and leg.exception() is None and leg.result()[0] < 400:
            answer = leg.result()[1]
        return UsageTap(cached_tokens=prefill_saved(answer, self.prefill))

    async def whole(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.answered = True
        if status < 400:
            body = (await self._tap()).answer(body)
        await self.sink.whole(status, headers, body)

    async def begin(self, status: int, headers: dict[str, str]) -> None:
        self.answered = True
        await self.sink.begin(status, headers)

    async def write(self, chunk: bytes) -> None:
        if carries_usage(chunk):
            chunk = (await self._tap()).chunk(chunk)
        await self.sink.write(chunk)

    async def end(self) -> None:
        await self.sink.end()


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` if it still runs and wait until it has stopped."""
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)
