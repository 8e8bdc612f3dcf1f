"""What the front ends call: :class:`FlowControl` (``flow.enabled``).

The waiting front ends (HTTP, gRPC ``Generate``) call :meth:`FlowControl.admit`: shed
when the pool is saturated and the request is sheddable, take from its rate limits, then
wait in the banded admission queue up to its band's longest wait. ``Pick`` and ext_proc
call :meth:`FlowControl.check`: the same shedding and rate limits, but no wait: the
gateway (or ``Pick``'s caller) holds the request and forwards it itself, so a refusal
(429 / ``RESOURCE_EXHAUSTED`` with ``Retry-After``) hands the retry back to it at once;
Envoy also bounds each ext_proc answer (``message_timeout``, 200 ms by default), which
is shorter than any useful wait. Every front end calls :meth:`FlowControl.finish` at the
end with the answer's usage, which corrects the token estimates.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from router.admission import Overloaded
from router.flow.fairness import make_fairness
from router.flow.isolation import PrefillIsolation
from router.flow.queue import BandedQueue
from router.flow.ratelimit import Limit, RateLimited, RateLimiter
from router.flow.saturation import Saturation
from router.flow.ticket import FlowTicket, Identities
from router.metric_catalogue import (
    FLOW_ADMITTED,
    FLOW_REFUSED,
    FLOW_WAIT_SECONDS,
    FLOW_WAITING,
    POOL_SATURATION,
    RATE_LIMIT_FALLBACKS,
)

if TYPE_CHECKING:
    from router.admission import Admission
    from router.config import Config
    from router.fleet.load import LoadTracker
    from router.fleet.registry import Registry
    from router.flow.config import FlowConfig
    from router.metric_catalogue import StateFamily

SHED_RETRY_AFTER_S = 1.0


def usage_tokens(usage: Mapping[str, Any] | None) -> tuple[int | None, int | None]:
    """(prompt, output) tokens of an answer's usage: OpenAI's, Anthropic's or Responses'."""
    if not isinstance(usage, Mapping):
        return None, None

    def number(*names: str) -> int | None:
        for name in names:
            value = usage.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    return number("prompt_tokens", "input_tokens"), number("completion_tokens", "output_tokens")


def band_label(priority: int) -> str:
    """A metrics label for a band: priorities are bounded to [-1000, 1000]."""
    return str(priority)


class FlowControl:
    """Priority bands, fairness, rate limits and shedding in front of the request plan."""

    def __init__(
        self,
        config: Config,
        admission: Admission,
        registry: Registry,
        loads: LoadTracker,
        redis_url: str | None = None,
    ) -> None:
        flow = config.flow
        self.flow: FlowConfig = flow
        self.admission = admission
        self.registry = registry
        self.identities = Identities(flow, config.limits.default_max_tokens)
        self.fairness = make_fairness(flow.fairness)
        self.queue = BandedQueue(self.fairness, flow.ordering)
        admission.flows = self.queue
        admission.tenant_share = flow.tenant_share
        self.limiter = RateLimiter(flow.rate_limit, redis_url)
        self.saturation = Saturation(
            lambda: self.flow.saturation,
            registry,
            loads,
            lambda: admission.limits.max_inflight_per_engine,
            self._queued,
        )
        self.isolation: PrefillIsolation | None = (
            PrefillIsolation(
                loads,
                admission.holding,
                lambda: self.flow.prefill_isolation_wait_s,
                lambda: config.disaggregation.prefill_s_per_token,
                lambda: self.flow.prefill_reserve,
                lambda: self.flow.prefill_reserve_window_s,
                self.queue.counts,
                self.queue.in_flow,
                admission.tenant_cap,
            )
            if flow.prefill_isolation
            else None
        )
        """Prefill isolation (``flow.prefill_isolation``); the routing core applies it."""
        self.admitted: dict[str, int] = {}
        """band -> requests admitted."""
        self.refused: dict[tuple[str, str], int] = {}
        """(band, reason) -> requests refused: ``shed``, ``rpm``, ``tpm``, ``band_full``,
        ``timeout``."""
        self.wait_sum: dict[str, float] = {}
        """band -> seconds waited by admitted requests."""
        self._tasks: set[asyncio.Task[None]] = set()
        self.named = {k.name for k in flow.keys if k.name} | {t.name for t in flow.tenants}

    # ------------------------------------------------------------------ tickets

    def ticket(
        self,
        headers: Mapping[str, str],
        body: bytes = b"",
        *,
        metadata: Mapping[str, object] | None = None,
        deadline: float | None = None,
    ) -> FlowTicket:
        """The request's ticket (:meth:`router.flow.ticket.Identities.ticket`)."""
        return self.identities.ticket(
            headers, body, metadata=metadata, deadline=deadline, now=time.monotonic()
        )

    def tenant_label(self, tenant: str) -> str:
        """Configured tenants and ``default`` by name; any other as ``other`` (bounded)."""
        return tenant if tenant in self.named or tenant == "default" else "other"

    def _queued(self, base: str) -> int:
        """Requests of ``base``'s pool waiting (those naming no model count for every pool)."""
        return sum(
            n
            for model, n in self.queue.by_model.items()
            if model is None or self.registry.base_of(model) == base
        )

    def _refuse(self, ticket: FlowTicket, reason: str) -> None:
        key = (band_label(ticket.priority), reason)
        self.refused[key] = self.refused.get(key, 0) + 1

    # ------------------------------------------------------------------ the gate

    def _limits(self, ticket: FlowTicket, tokens: int) -> list[Limit]:
        ids = self.identities
        out: list[Limit] = []
        owners: list[tuple[str, str, int | None, int | None]] = []
        if ticket.key is not None:
            entry = ids.by_name.get(ticket.key)
            if entry is not None:
                owners.append((f"key:{ticket.key}", f"key '{ticket.key}'", entry.rpm, entry.tpm))
        tenant = ids.tenants.get(ticket.tenant)
        if tenant is not None:
            owners.append(
                (f"tenant:{ticket.tenant}", f"tenant '{ticket.tenant}'", tenant.rpm, tenant.tpm)
            )
        for bucket, owner, rpm, tpm in owners:
            if rpm is not None:
                out.append(Limit(f"{bucket}:rpm", rpm, 1, "requests", owner))
            if tpm is not None and tokens:
                out.append(Limit(f"{bucket}:tpm", tpm, tokens, "tokens", owner))
        return out

    def shed(self) -> int:
        """Refuse every queued sheddable request of a saturated pool; how many went."""
        cfg = self.flow.saturation
        gone = 0
        saturated: dict[str | None, bool] = {}
        for waiter in self.queue.sheddable():
            model = waiter.ticket.model
            if model not in saturated:
                saturated[model] = self.saturation.of(model) >= cfg.shed_at
            if saturated[model]:
                self._refuse(waiter.ticket, "shed")
                self.admission.evict(waiter, self._shed_error(waiter.ticket))
                gone += 1
        return gone

    def _shed_error(self, ticket: FlowTicket) -> Overloaded:
        return Overloaded(
            f"the pool is saturated: sheddable request (priority {ticket.priority}) refused",
            retry_after=SHED_RETRY_AFTER_S,
            reason="shed",
        )

    async def check(self, ticket: FlowTicket) -> None:
        """Shedding and rate limits, without waiting (raises 429 :class:`ApiError`)."""
        saturated = self.saturation.of(ticket.model) >= self.flow.saturation.shed_at
        if saturated:
            self.shed()
            if ticket.sheddable:
                self._refuse(ticket, "shed")
                raise self._shed_error(ticket)
        limits = self._limits(ticket, ticket.estimate)
        try:
            await self.limiter.take(limits)
        except RateLimited as err:
            self._refuse(ticket, err.limit.bucket.rsplit(":", 1)[1])
            raise
        ticket.charged = {lim.bucket: lim.cost for lim in limits if lim.what == "tokens"}

    async def admit(self, ticket: FlowTicket, deadline: float) -> None:
        """:meth:`check`, then wait for an in-flight slot in the banded queue until
        ``deadline`` or the band's ``flow.max_wait_s`` (raises 429 / 503)."""
        await self.check(ticket)
        flow = self.flow
        wait = flow.max_wait_s.get(ticket.priority)
        if wait is not None:
            deadline = min(deadline, time.monotonic() + wait)
        if ticket.deadline is not None:
            deadline = min(deadline, ticket.deadline)
        try:
            await self.admission.enter(
                deadline,
                ticket,
                band_queue=flow.band_queue,
                timeout_status=flow.max_wait_status,
            )
        except Overloaded as err:
            if err.reason != "shed":  # a shed one was counted when evicted
                self._refuse(ticket, err.reason or "band_full")
            self._give_back(ticket)
            raise
        except asyncio.CancelledError:
            self._give_back(ticket)
            raise
        band = band_label(ticket.priority)
        self.admitted[band] = self.admitted.get(band, 0) + 1
        self.wait_sum[band] = self.wait_sum.get(band, 0.0) + ticket.waited_s
        self.fairness.charge(ticket.tenant, ticket.estimate)
        ticket.admitted = True

    def _give_back(self, ticket: FlowTicket) -> None:
        """A request refused after its rate limits were taken: its tokens go back."""
        ticket.finished = True
        limits = self._limits(ticket, 1)
        back = [
            Limit(lim.bucket, lim.limit, -ticket.charged.get(lim.bucket, 1), lim.what, lim.owner)
            for lim in limits
        ]
        self._spawn(self.limiter.add(back))

    # ------------------------------------------------------------------ the end

    def finish(self, ticket: FlowTicket, usage: Mapping[str, Any] | None) -> None:
        """The request ended: correct its token estimate from ``usage`` (if any)."""
        if ticket.finished:
            return
        ticket.finished = True
        prompt, output = usage_tokens(usage)
        if prompt is None and output is None:
            return
        if prompt is None:  # what the usage leaves out stays as estimated
            prompt = ticket.prompt_estimate
        if output is None:
            output = ticket.estimate - ticket.prompt_estimate
        delta = prompt + output - ticket.estimate
        if not delta:
            return
        if ticket.admitted:  # Pick and ext_proc tickets never charged fairness
            self.fairness.charge(ticket.tenant, delta)
        limits = [
            Limit(lim.bucket, lim.limit, delta, lim.what, lim.owner)
            for lim in self._limits(ticket, 1)
            if lim.what == "tokens"
        ]
        if limits:
            self._spawn(self.limiter.add(limits))

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.limiter.close()

    def metric_families(self) -> Iterator[StateFamily]:
        """Pool saturation, the banded queue, admissions and refusals by band, rate-limit
        fallbacks, and prefill isolation's counters when it is on."""
        saturation = self.saturation.all()
        yield POOL_SATURATION.labelled(((m,), v) for m, v in sorted(saturation.items()))
        waiting: dict[tuple[str, str], int] = {}
        for (band, tenant), n in self.queue.counts().items():
            key = (str(band), self.tenant_label(tenant))
            waiting[key] = waiting.get(key, 0) + n
        yield FLOW_WAITING.labelled(sorted(waiting.items()))
        yield FLOW_ADMITTED.labelled(((b,), n) for b, n in sorted(self.admitted.items()))
        yield FLOW_WAIT_SECONDS.labelled(((b,), s) for b, s in sorted(self.wait_sum.items()))
        yield FLOW_REFUSED.labelled(sorted(self.refused.items()))
        yield RATE_LIMIT_FALLBACKS.value(self.limiter.fallbacks)
        if self.isolation is not None:
            yield from self.isolation.metric_families()
