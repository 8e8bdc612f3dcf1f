"""Prefill isolation (router/flow/isolation.py): which engines a request is kept off,
when it waits, and when it stops waiting. Pure: a load tracker, tickets and a clock."""

from __future__ import annotations

import pytest

from router.fleet.load import LoadTracker
from router.flow.isolation import PrefillIsolation, Yielding
from router.flow.ticket import FlowTicket
from router.policy.base import RouteRequest
from router.types import EngineKey

A, B = EngineKey("a:1"), EngineKey("b:1")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def loads(clock: Clock) -> LoadTracker:
    return LoadTracker(16, clock=clock, track_prefills=True)


def isolation(
    loads: LoadTracker, clock: Clock, holding: dict[str, int] | None = None, reserve: int = 0
) -> PrefillIsolation:
    return PrefillIsolation(
        loads,
        holding or {},
        max_wait_s=lambda: 1.0,
        s_per_token=lambda: 50e-6,
        reserve=lambda: reserve,
        window_s=lambda: 10.0,
        clock=clock,
    )


def route(flow: FlowTicket, wait_until: float | None = None) -> RouteRequest:
    return RouteRequest("r", [], 100, 16, 8, wait_until=wait_until, flow=flow)


def test_a_lower_band_is_kept_off_an_engine_prefilling_a_higher_band(
    loads: LoadTracker, clock: Clock
) -> None:
    iso = isolation(loads, clock)
    loads.begin(A, 10_000, 0, 8, FlowTicket("t1", priority=1))
    assert iso.clear(route(FlowTicket("t2", priority=0)), [A, B]) == [B]
    assert iso.counters.avoided == 1
    # The same band, or a higher one, is not kept off.
    assert iso.clear(route(FlowTicket("t2", priority=1)), [A, B]) == [A, B]
    assert iso.clear(route(FlowTicket("t2", priority=2)), [A, B]) == [A, B]


def test_within_a_band_a_tenant_with_a_backlog_is_outranked_by_a_quieter_one(
    loads: LoadTracker, clock: Clock
) -> None:
    holding = {"quiet": 1, "noisy": 2}
    waiting = {(0, "noisy"): 0}
    iso = isolation(loads, clock, holding)
    iso.in_flow = lambda priority, tenant: waiting.get((priority, tenant), 0)
    loads.begin(A, 10_000, 0, 8, FlowTicket("quiet", priority=0))
    # Noisy holds more, but nothing of it waits: served as it asks, outranked by nobody.
    assert iso.clear(route(FlowTicket("noisy", priority=0)), [A, B]) == [A, B]
    waiting[(0, "noisy")] = 1  # a backlog: the quieter tenant's prefill outranks it
    assert iso.clear(route(FlowTicket("noisy", priority=0)), [A, B]) == [B]
    holding["noisy"], holding["quiet"] = 1, 3  # now quiet has as many in flight and waiting
    assert iso.clear(route(FlowTicket("noisy", priority=0)), [A, B]) == [A, B]
    # A tenant is never kept off its own prefills.
    assert iso.clear(route(FlowTicket("quiet", priority=0)), [A, B]) == [A, B]


def test_a_first_token_or_an_end_clears_the_engine_and_wakes_waiters(
    loads: LoadTracker, clock: Clock
) -> None:
    woken: list[int] = []
    loads.on_end = lambda: woken.append(1)
    iso = isolation(loads, clock)
    high = loads.begin(A, 10_000, 0, 8, FlowTicket("t1", priority=1))
    other = loads.begin(B, 10_000, 0, 8, FlowTicket("t1", priority=1))
    low = route(FlowTicket("t2", priority=0))
    assert iso.clear(low, [A, B]) == [A, B]  # both blocked, and it may not wait
    assert iso.counters.overridden == 1
    loads.prefilled(high)
    assert woken == [1]
    assert iso.clear(low, [A, B]) == [A]
    loads.end(other)
    assert A not in loads.prefilling and B not in loads.prefilling
    assert iso.clear(low, [A, B]) == [A, B]


def test_a_request_that_cannot_wait_is_routed_anyway_and_counted(
    loads: LoadTracker, clock: Clock
) -> None:
    iso = isolation(loads, clock)
    loads.begin(A, 10_000, 0, 8, FlowTicket("t1", priority=1))
    assert iso.clear(route(FlowTicket("t2", priority=0)), [A]) == [A]
    assert iso.counters.overridden == 1
    assert iso.counters.waited == 0


def test_a_request_that_may_wait_yields_until_its_wait_runs_out(
    loads: LoadTracker, clock: Clock
) -> None:
    iso = isolation(loads, clock)
    loads.begin(A, 10_000, 0, 8, FlowTicket("t1", priority=1))
    flow = FlowTicket("t2", priority=0)
    request = route(flow, wait_until=clock.now + 30)
    with pytest.raises(Yielding) as raised:
        iso.clear(request, [A])
    assert raised.value.until == pytest.approx(clock.now + 1.0)  # the isolation wait
    assert iso.counters.waited == 1
    clock.now += 0.4
    with pytest.raises(Yielding):
        iso.clear(request, [A])
    assert iso.counters.waited == 1  # one request, counted once
    clock.now += 0.6
    assert iso.clear(request, [A]) == [A]
    assert iso.counters.overridden == 1
    assert flow.yielded_s == pytest.approx(1.0)
    assert "yielded=1.000s" in flow.describe()


def test_the_wait_ends_early_when_an_engine_comes_clear(loads: LoadTracker, clock: Clock) -> None:
    iso = isolation(loads, clock)
    high = loads.begin(A, 10_000, 0, 8, FlowTicket("t1", priority=1))
    flow = FlowTicket("t2", priority=0)
    request = route(flow, wait_until=clock.now + 30)
    with pytest.raises(Yielding):
        iso.clear(request, [A])
    clock.now += 0.25
    loads.prefilled(high)
    assert iso.clear(request, [A]) == [A]
    assert iso.counters.overridden == 0
    assert flow.yielded_s == pytest.approx(0.25)
    assert iso.counters.wait_s == pytest.approx(0.25)


def test_an_unseen_first_token_stops_outranking_after_its_estimate(
    loads: LoadTracker, clock: Clock
) -> None:
    """A non-streamed answer shows no first token: its prefill is estimated (2,000
    uncached tokens x 50 us, doubled: 0.2 s), and the wait ends with the estimate."""
    iso = isolation(loads, clock)
    loads.begin(A, 2_000, 0, 8, FlowTicket("t1", priority=1), sees_first_token=False)
    loads.begin(B, 2_000, 0, 8, FlowTicket("t1", priority=1))  # streamed: no estimate
    request = route(FlowTicket("t2", priority=0), wait_until=clock.now + 30)
    with pytest.raises(Yielding) as raised:
        iso.clear(request, [A, B])
    assert raised.value.until == pytest.approx(clock.now + 0.2)
    clock.now += 0.2
    assert iso.clear(request, [A, B]) == [A]
    assert iso.counters.overridden == 0


def test_cached_prompts_and_requests_without_a_ticket_are_not_tracked(
    loads: LoadTracker, clock: Clock
) -> None:
    loads.begin(A, 2_000, 2_000, 8, FlowTicket("t1", priority=1))  # nothing to prefill
    loads.begin(B, 2_000, 0, 8)  # flow control off
    assert loads.prefilling == {}
    loads.forget(A)
    ticket = loads.begin(A, 2_000, 0, 8, FlowTicket("t1", priority=1))
    assert list(loads.prefilling[A]) == [ticket.id]
    loads.forget(A)
    assert loads.prefilling == {}


C = EngineKey("c:1")


def test_the_reserve_keeps_engines_free_of_lower_prefills_while_higher_ones_are_about(
    loads: LoadTracker, clock: Clock
) -> None:
    """Three engines, one reserved: while the high band has been seen within the window,
    low-band prefills run one an engine on at most two engines; a third waits."""
    iso = isolation(loads, clock, reserve=1)
    low = [FlowTicket("t2", priority=0) for _ in range(4)]
    # No high request seen yet: nothing is reserved.
    loads.begin(A, 2_000, 0, 8, low[0])
    assert iso.clear(route(low[1]), [A, B, C]) == [A, B, C]
    # A high request is routed: for the next 10 s the reserve holds.
    assert iso.clear(route(FlowTicket("t1", priority=1)), [A, B, C]) == [A, B, C]
    assert iso.clear(route(low[1]), [A, B, C]) == [B, C]  # not beside A's low prefill
    assert iso.counters.reserved == 1
    loads.begin(B, 2_000, 0, 8, low[1])
    with pytest.raises(Yielding):  # two engines prefill low requests: C is kept
        iso.clear(route(low[2], wait_until=clock.now + 30), [A, B, C])
    assert iso.clear(route(low[3]), [A, B, C]) == [A, B, C]  # Pick: no wait, no block
    # The high band is never held back by the reserve.
    assert iso.clear(route(FlowTicket("t1", priority=1)), [A, B, C]) == [A, B, C]
    # Out of the window, the reserve lapses.
    clock.now += 10.5
    assert iso.clear(route(low[3]), [A, B, C]) == [A, B, C]


def test_a_request_waits_while_a_higher_band_waits_for_a_slot(
    loads: LoadTracker, clock: Clock
) -> None:
    """Outranking requests waiting for a slot take engines from the lower ranks as
    reserved ones do: with two waiting in a pool of three, one engine is left."""
    waiting: dict[tuple[int, str], int] = {}
    iso = isolation(loads, clock, reserve=1)
    iso.queued = lambda: waiting
    iso.clear(route(FlowTicket("t1", priority=1)), [A, B, C])  # the high band is about
    request = route(FlowTicket("t2", priority=0), wait_until=clock.now + 30)
    assert iso.clear(request, [A, B, C]) == [A, B, C]
    waiting[(1, "t1")] = 1
    waiting[(0, "t2")] = 5  # its own tenant's: no matter
    waiting[(-1, "t3")] = 5  # lower: no matter
    loads.begin(A, 2_000, 0, 8, FlowTicket("t2", priority=0))
    # No high request prefills: its end would free no slot for the waiting one, so the
    # waiting one does not count (holding this back could keep it from a slot).
    assert iso.clear(request, [A, B, C]) == [B, C]
    loads.begin(B, 2_000, 0, 8, FlowTicket("t1", priority=1))
    # One high request prefills and one waits: two engines for them, one low prefill.
    with pytest.raises(Yielding):
        iso.clear(request, [A, B, C])
    waiting[(1, "t1")] = 0
    assert iso.clear(request, [A, B, C]) == [C]


def test_the_reserve_frees_up_as_prefills_end(loads: LoadTracker, clock: Clock) -> None:
    iso = isolation(loads, clock, reserve=1)
    iso.clear(route(FlowTicket("t1", priority=1)), [A, B])  # the high band is about
    first = loads.begin(A, 2_000, 0, 8, FlowTicket("t2", priority=0))
    request = route(FlowTicket("t2", priority=0), wait_until=clock.now + 30)
    with pytest.raises(Yielding):  # A prefills a low request, B is kept
        iso.clear(request, [A, B])
    loads.prefilled(first)
    high = loads.begin(A, 2_000, 0, 8, FlowTicket("t1", priority=1))
    assert iso.clear(request, [A, B]) == [B]  # A prefills a high request now
    loads.begin(B, 2_000, 0, 8, FlowTicket("t2", priority=0))
    loads.prefilled(high)
    with pytest.raises(Yielding):  # B prefills a low request, A is kept
        iso.clear(route(FlowTicket("t2", priority=0), wait_until=clock.now + 30), [A, B])


def test_a_pool_of_one_engine_is_never_reserved(loads: LoadTracker, clock: Clock) -> None:
    iso = isolation(loads, clock, reserve=1)
    iso.clear(route(FlowTicket("t1", priority=1)), [A])
    loads.begin(A, 2_000, 0, 8, FlowTicket("t2", priority=0))
    assert iso.clear(route(FlowTicket("t2", priority=0)), [A]) == [A]
    assert iso.counters.reserved == 0


def test_the_classes_remembered_are_bounded(loads: LoadTracker, clock: Clock) -> None:
    from router.flow.isolation import MAX_CLASSES

    iso = isolation(loads, clock, reserve=1)
    for i in range(3 * MAX_CLASSES):
        clock.now += 0.0001  # all within the window: a flood of tenant names
        iso.clear(route(FlowTicket(f"t{i}", priority=0)), [A, B])
    assert len(iso.seen) <= MAX_CLASSES + 1
    assert (0, f"t{3 * MAX_CLASSES - 1}") in iso.seen


def test_a_tenant_with_a_backlog_is_outranked_by_one_without(
    loads: LoadTracker, clock: Clock
) -> None:
    """As many in flight, but one tenant has requests waiting: the other outranks it."""
    waiting = {(0, "noisy"): 300}
    iso = isolation(loads, clock, {"quiet": 2, "noisy": 2})
    iso.in_flow = lambda priority, tenant: waiting.get((priority, tenant), 0)
    loads.begin(A, 2_000, 0, 8, FlowTicket("quiet", priority=0))
    assert iso.clear(route(FlowTicket("noisy", priority=0)), [A, B]) == [B]
    loads.prefilling.clear()
    loads.begin(A, 2_000, 0, 8, FlowTicket("noisy", priority=0))
    assert iso.clear(route(FlowTicket("quiet", priority=0)), [A, B]) == [A, B]


def test_counters_count_decisions_not_tries(loads: LoadTracker, clock: Clock) -> None:
    """A request woken again and again while it waits is counted once when routed."""
    iso = isolation(loads, clock, reserve=1)
    iso.queued = lambda: {(1, "t1"): 1}  # one more high request waits for a slot
    iso.clear(route(FlowTicket("t1", priority=1)), [A, B, C])  # the high band is about
    high = loads.begin(A, 2_000, 0, 8, FlowTicket("t1", priority=1))
    low = loads.begin(B, 2_000, 0, 8, FlowTicket("t2", priority=0))
    request = route(FlowTicket("t2", priority=0), wait_until=clock.now + 30)
    for _ in range(3):
        with pytest.raises(Yielding):
            iso.clear(request, [A, B, C])
    loads.prefilled(low)
    assert iso.clear(request, [A, B, C]) == [B, C]
    loads.prefilled(high)
    assert (iso.counters.avoided, iso.counters.reserved, iso.counters.waited) == (1, 0, 1)


def test_an_estimated_prefill_past_its_estimate_is_forgotten(
    loads: LoadTracker, clock: Clock
) -> None:
    iso = isolation(loads, clock)
    loads.begin(A, 2_000, 0, 8, FlowTicket("t1", priority=1), sees_first_token=False)
    clock.now += 0.5  # the estimate: 0.2 s
    assert iso.clear(route(FlowTicket("t2", priority=0)), [A, B]) == [A, B]
    assert loads.prefilling == {}


def test_nothing_is_tracked_unless_isolation_is_on(clock: Clock) -> None:
    loads = LoadTracker(16, clock=clock)
    loads.begin(A, 2_000, 0, 8, FlowTicket("t1", priority=1))
    assert loads.prefilling == {}


def test_a_tenant_at_its_share_counts_as_one_with_a_backlog(
    loads: LoadTracker, clock: Clock
) -> None:
    iso = isolation(loads, clock, {"quiet": 1, "noisy": 2})
    loads.begin(A, 2_000, 0, 8, FlowTicket("quiet", priority=0))
    assert iso.clear(route(FlowTicket("noisy", priority=0)), [A, B]) == [A, B]  # no cap
    iso.tenant_cap = lambda: 2  # noisy holds all its share lets it
    assert iso.clear(route(FlowTicket("noisy", priority=0)), [A, B]) == [B]
