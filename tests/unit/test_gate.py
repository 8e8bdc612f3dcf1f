"""The FIFO gate (:class:`router.serving.gate.AdmissionGate`): its refusals and its slot."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from router.admission import Admission, Overloaded
from router.config import LimitsConfig
from router.serving.errors import Draining, TooManyInFlight
from router.serving.gate import AdmissionGate, Entry, Permit
from router.serving.services import RunState


def gate(max_inflight: int = 2, admission_queue: int = 0) -> tuple[AdmissionGate, Any]:
    limits = LimitsConfig(max_inflight=max_inflight, admission_queue=admission_queue)
    loads = SimpleNamespace(in_flight=0)
    live = SimpleNamespace(current=SimpleNamespace(limits=limits))
    return AdmissionGate(Admission(limits), RunState(), loads, live), loads  # type: ignore[arg-type]


def test_a_draining_router_refuses_with_503_and_retry_after() -> None:
    g, _ = gate()
    g.refuse_closed()
    g.state.draining = True
    with pytest.raises(Draining) as err:
        g.refuse_closed()
    assert (err.value.status, err.value.retry_after) == (503, 1)
    assert err.value.message == "the router is shutting down"


def test_the_no_wait_front_ends_are_refused_at_max_inflight() -> None:
    g, loads = gate(max_inflight=2)
    loads.in_flight = 1
    g.refuse_full()
    loads.in_flight = 2
    with pytest.raises(TooManyInFlight) as err:
        g.refuse_full()
    assert (err.value.status, err.value.message) == (429, "too many requests in flight")


async def test_a_slot_is_taken_before_the_body_is_read_and_given_back_once() -> None:
    g, _ = gate(max_inflight=1)
    seen: list[tuple[int, int]] = []

    async def read() -> bytes:
        seen.append((g.admission.in_flight, g.admission.reading_body))
        return b"{}"

    permit = Permit()
    await g.enter(Entry({}, read=read), g.deadline(), permit)
    assert (permit.body, permit.ticket, seen) == (b"{}", None, [(1, 1)])
    assert g.admission.reading_body == 0
    with pytest.raises(Overloaded):  # no queue: the second one is refused at once
        await g.enter(Entry({}, b"x"), g.deadline(), Permit())
    g.leave(permit, None)
    g.leave(permit, None)
    assert g.admission.in_flight == 0
    assert await g.check(Entry({})) is None


async def test_a_body_that_fails_to_arrive_still_gives_its_slot_back() -> None:
    g, _ = gate(max_inflight=1)

    async def read() -> bytes:
        raise TimeoutError

    permit = Permit()
    with pytest.raises(TimeoutError):
        await g.enter(Entry({}, read=read), g.deadline(), permit)
    g.leave(permit, None)
    assert (g.admission.in_flight, g.admission.reading_body) == (0, 0)
