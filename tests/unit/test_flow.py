"""Flow control's pure parts: tickets, the banded queue, fairness, token buckets,
saturation (router/flow/)."""

from __future__ import annotations

import asyncio

import pytest

from router.flow.config import FlowConfig, FlowSaturationConfig
from router.flow.control import usage_tokens
from router.flow.fairness import RoundRobin, VirtualTokenCounter
from router.flow.queue import BandedQueue
from router.flow.ratelimit import Limit, LocalBuckets
from router.flow.saturation import engine_saturation, pool_saturation
from router.flow.ticket import FlowTicket, Identities, body_facts
from router.security import key_digest


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ids(**flow: object) -> Identities:
    return Identities(FlowConfig.model_validate(flow), default_max_tokens=100)


# --------------------------------------------------------------------------- tickets


def test_the_priority_header_wins_over_the_keys_default_and_is_capped() -> None:
    who = ids(keys=[{"key": "k1", "name": "team-a", "priority": 2, "max_priority": 5}])
    auth = {"authorization": "Bearer k1"}
    assert who.ticket(auth).priority == 2
    assert who.ticket({**auth, "x-kvroute-priority": "-3"}).priority == -3
    assert who.ticket({**auth, "x-kvroute-priority": "9"}).priority == 5
    assert who.ticket({"x-kvroute-priority": "junk"}).priority == 0
    capped = ids(max_priority=1)
    assert capped.ticket({"x-kvroute-priority": "9"}).priority == 1
    assert capped.ticket({}, metadata={"priority": 9}).priority == 9  # the gateway's word


def test_gateway_metadata_and_objectives_give_a_priority() -> None:
    who = ids(objectives={"batch": -1, "chat": 3})
    assert who.ticket({"x-gateway-inference-objective": "chat"}).priority == 3
    assert who.ticket({}, metadata={"priority": 7}).priority == 7
    assert who.ticket({}, metadata={"tenant": "gw-t"}).tenant == "gw-t"


def test_the_tenant_comes_from_the_first_source_configured() -> None:
    body = b'{"prompt": "x", "user": "alice"}'
    who = ids(keys=[{"key": "k1", "name": "team-a", "may_set_tenant": True}])
    auth = {"authorization": "Bearer k1"}
    assert who.ticket({**auth, "x-kvroute-tenant": "t9"}, body).tenant == "t9"
    assert who.ticket(auth, body).tenant == "team-a"
    assert who.ticket({}, body).tenant == "alice"
    assert who.ticket({"x-kvroute-tenant": "t9"}, body).tenant == "t9"  # an unlisted caller
    assert who.ticket({}).tenant == "default"
    only_user = ids(tenant_from=["user"])
    assert only_user.ticket({**auth, "x-kvroute-tenant": "t9"}, body).tenant == "alice"
    unnamed = ids(tenant_from=["api_key"]).ticket({"authorization": "Bearer secret-1"})
    assert unnamed.tenant == key_digest("secret-1") and "secret" not in unnamed.tenant


def test_a_listed_keys_tenant_wins_over_what_its_client_names() -> None:
    body = b'{"prompt": "x", "user": "alice"}'
    who = ids(
        keys=[{"key": "k1", "name": "team-a"}, {"key": "k2"}],
        tenant_from=["header", "user", "api_key"],
    )
    named = {"authorization": "Bearer k1", "x-kvroute-tenant": "team-b"}
    assert who.ticket(named, body).tenant == "team-a"
    assert who.ticket({"x-api-key": "k1"}, body).tenant == "team-a"
    unnamed = {"authorization": "Bearer k2", "x-kvroute-tenant": "team-b"}
    assert who.ticket(unnamed, body).tenant == key_digest("k2")
    # The gateway's metadata is the operator's word, not the client's.
    assert who.ticket(named, metadata={"tenant": "gw-t"}).tenant == "gw-t"


def test_the_estimate_is_prompt_bytes_over_four_plus_the_output_budget() -> None:
    body = b'{"prompt": "' + b"x" * 388 + b'", "max_tokens": 7, "n": 2}'
    facts = body_facts(body)
    assert facts.output_tokens == 14 and facts.prompt_tokens == len(body) // 4
    assert ids().ticket({}, b'{"prompt": "hi"}').estimate == 4 + 100  # default_max_tokens
    assert body_facts(b"not json").prompt_tokens == 2


def test_a_deadline_header_sets_the_tickets_deadline() -> None:
    ticket = ids().ticket({"x-kvroute-deadline-ms": "250"}, now=10.0)
    assert ticket.deadline == pytest.approx(10.25)
    assert ids().ticket({"x-kvroute-deadline-ms": "250"}, deadline=10.1, now=10.0).deadline == 10.1


# --------------------------------------------------------------------------- the queue


def _queue(fairness: object = None, ordering: str = "fifo") -> BandedQueue:
    return BandedQueue(fairness or RoundRobin(), ordering)  # type: ignore[arg-type]


def _push(q: BandedQueue, tenant: str, priority: int = 0, deadline: float | None = None) -> str:
    loop = asyncio.new_event_loop()
    try:
        q.push(FlowTicket(tenant, priority, deadline=deadline), loop.create_future())
    finally:
        loop.close()
    return tenant


def _drain(q: BandedQueue) -> list[tuple[str, int]]:
    out = []
    while (w := q.pop()) is not None:
        out.append((w.ticket.tenant, w.ticket.priority))
    return out


def test_bands_are_served_strictly_by_priority() -> None:
    q = _queue()
    for tenant, priority in [("a", 0), ("b", -1), ("c", 5), ("d", 0)]:
        _push(q, tenant, priority)
    assert [p for _, p in _drain(q)] == [5, 0, 0, -1]
    assert len(q) == 0


def test_round_robin_alternates_flows_within_a_band() -> None:
    q = _queue(RoundRobin())
    for _ in range(4):
        _push(q, "noisy")
    _push(q, "quiet")
    _push(q, "quiet")
    order = [t for t, _ in _drain(q)]
    assert order[:4] == ["noisy", "quiet", "noisy", "quiet"]


def test_vtc_serves_the_tenant_with_the_fewest_tokens_served() -> None:
    """Both tenants keep requests waiting; the heavy one's cost 10x the light one's, so
    the light one is served about ten times as often."""
    vtc = VirtualTokenCounter()
    q = _queue(vtc)
    cost = {"heavy": 1000, "light": 100}
    for _ in range(12):
        _push(q, "heavy")
        _push(q, "light")
    served = []
    for _ in range(12):
        tenant = q.pop().ticket.tenant  # type: ignore[union-attr]
        vtc.charge(tenant, cost[tenant])
        served.append(tenant)
    assert served[:12] == ["heavy", *["light"] * 10, "heavy"]


def test_vtc_lifts_a_returning_tenant_to_the_smallest_waiting_counter() -> None:
    vtc = VirtualTokenCounter()
    vtc.charge("busy", 5000)
    q = _queue(vtc)
    _push(q, "busy")
    _push(q, "idle")  # was away: starts at busy's counter, banks no credit
    assert vtc.counters["idle"] == 5000


def test_deadline_ordering_serves_the_earliest_deadline_first_then_arrival() -> None:
    q = _queue(ordering="deadline")
    ticket_order = [("a", None), ("a", 9.0), ("a", 3.0), ("a", None)]
    for tenant, deadline in ticket_order:
        _push(q, tenant, deadline=deadline)
    deadlines = []
    while (w := q.pop()) is not None:
        deadlines.append(w.ticket.deadline)
    assert deadlines == [3.0, 9.0, None, None]


def test_a_removed_waiter_is_gone_at_once_and_never_served() -> None:
    q = _queue()
    loop = asyncio.new_event_loop()
    try:
        first = q.push(FlowTicket("a", 0), loop.create_future())
        q.push(FlowTicket("b", -1), loop.create_future())
        q.remove(first)
        assert len(q) == 1 and q.in_band(0) == 0 and q.by_model == {None: 1}
        assert [w.ticket.tenant for w in q.sheddable()] == ["b"]
        assert q.pop().ticket.tenant == "b"  # type: ignore[union-attr]
        assert q.pop() is None and q.by_model == {}
    finally:
        loop.close()


# --------------------------------------------------------------------------- buckets


def _rpm(limit: int, cost: int = 1, bucket: str = "key:a:rpm") -> Limit:
    return Limit(bucket, limit, cost, "requests", "key 'a'")


def test_a_bucket_passes_its_burst_then_its_rate() -> None:
    clock = Clock()
    buckets = LocalBuckets(clock)
    shaped = [(_rpm(60), 1.0, 3.0)]  # 1 per second, 3 at once
    assert [buckets.take(shaped)[0] for _ in range(4)] == [-1, -1, -1, 0]
    assert buckets.take(shaped)[1] == pytest.approx(1.0)
    clock.now = 1.0
    assert buckets.take(shaped)[0] == -1


def test_buckets_that_refilled_are_forgotten() -> None:
    clock = Clock()
    buckets = LocalBuckets(clock)
    shaped = [(_rpm(60), 1.0, 3.0)]
    other = [(Limit("key:b:rpm", 60, 1, "requests", "key 'b'"), 1.0, 3.0)]
    buckets.take(shaped)
    clock.now = 0.5
    buckets.take(other)
    clock.now = 1.2  # the first has refilled to 3, the second holds 2.7
    buckets.forget_full(1.0, 3.0)
    assert len(buckets) == 1
    assert [buckets.take(other)[0] for _ in range(3)] == [-1, -1, 0]  # remembered: 2.7
    assert [buckets.take(shaped)[0] for _ in range(4)] == [-1, -1, -1, 0]  # a full one


def test_a_request_takes_from_every_bucket_or_from_none() -> None:
    buckets = LocalBuckets(Clock())
    rpm = (_rpm(60), 1.0, 5.0)
    tpm = (Limit("key:a:tpm", 600, 400, "tokens", "key 'a'"), 10.0, 500.0)
    assert buckets.take([rpm, tpm])[0] == -1
    assert buckets.take([rpm, tpm])[0] == 1  # tokens short: the request bucket keeps its own
    assert buckets.take([rpm])[0] == -1


def test_a_request_larger_than_the_bucket_passes_when_it_is_full() -> None:
    buckets = LocalBuckets(Clock())
    big = [(Limit("t", 100, 1000, "tokens", "key 'a'"), 1.0, 100.0)]
    assert buckets.take(big)[0] == -1
    assert buckets.take(big)[0] == 0  # in debt now


def test_usage_is_read_in_every_api_shape() -> None:
    assert usage_tokens({"prompt_tokens": 3, "completion_tokens": 4}) == (3, 4)
    assert usage_tokens({"input_tokens": 5, "output_tokens": 6}) == (5, 6)
    assert usage_tokens(None) == (None, None)


def test_extproc_finds_the_usage_at_an_answers_end() -> None:
    from router.frontends.extproc import usage_in

    sse = (
        b'data: {"choices":[{"text":"say \\"prompt_tokens\\": 9"}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3,'
        b'"prompt_tokens_details":{"cached_tokens":8}}}\n\ndata: [DONE]\n\n'
    )
    assert usage_in(sse) == {"prompt_tokens": 12, "completion_tokens": 3}
    body = b'{"id":"x","usage": {"prompt_tokens": 7, "completion_tokens": 1}}'
    assert usage_in(body) == {"prompt_tokens": 7, "completion_tokens": 1}
    anthropic = b'event: message_delta\ndata: {"usage":{"output_tokens":5}}\n\n'
    assert usage_in(anthropic) == {"output_tokens": 5}
    assert usage_in(b"data: [DONE]\n\n") is None


# --------------------------------------------------------------------------- saturation


def test_engine_saturation_is_its_fullest_signal_capped_at_one() -> None:
    cfg = FlowSaturationConfig(engine_waiting=4, engine_queued_tokens=1000)
    sat = engine_saturation
    idle = sat(cfg, kv_usage=None, waiting=None, queued_tokens=0, inflight=0, inflight_limit=8)
    assert idle == 0.0
    kv = sat(cfg, kv_usage=0.5, waiting=1, queued_tokens=100, inflight=2, inflight_limit=8)
    assert kv == 0.5
    assert sat(cfg, kv_usage=0.1, waiting=8, queued_tokens=0, inflight=0, inflight_limit=8) == 1.0
    assert pool_saturation([], 0, 16) == 1.0
    assert pool_saturation([0.2, 0.4], 4, 16) == pytest.approx(0.3)
    assert pool_saturation([0.2, 0.4], 8, 16) == 0.5


def test_saturation_rises_monotonically_with_offered_load() -> None:
    cfg = FlowSaturationConfig()
    values = []
    for load in range(0, 200, 5):
        engines = [
            engine_saturation(
                cfg,
                kv_usage=min(1.0, load / 150),
                waiting=max(0, load - 64) / 4,
                queued_tokens=load * 300,
                inflight=min(load, 64),
                inflight_limit=64,
            )
            for _ in range(2)
        ]
        values.append(pool_saturation(engines, max(0, load - 128), cfg.queue_waiting))
    assert values == sorted(values) and values[0] == 0.0 and values[-1] == 1.0


def test_vtc_forgets_idle_tenants_beyond_its_bound() -> None:
    from router.flow.fairness import MAX_TENANTS

    vtc = VirtualTokenCounter()
    for i in range(MAX_TENANTS + 10):
        vtc.charge(f"user-{i}", 1.0)
    vtc.activated("new", ["user-1"])
    assert set(vtc.counters) == {"user-1", "new"} and vtc.counters["new"] == 1.0


def test_an_answers_usage_corrects_only_what_it_reports() -> None:
    """An Anthropic stream's end reports output tokens alone: the prompt's part of the
    estimate stands, the output's is corrected."""
    from router.admission import Admission
    from router.config import Config
    from router.fleet.load import LoadTracker
    from router.fleet.registry import Registry
    from router.flow.control import FlowControl

    config = Config(flow={"enabled": True})
    flow = FlowControl(config, Admission(config.limits), Registry(config.health), LoadTracker())
    body = b'{"prompt": "' + b"x" * 396 + b'", "max_tokens": 100}'
    ticket = flow.ticket({}, body)
    assert (ticket.prompt_estimate, ticket.estimate) == (len(body) // 4, len(body) // 4 + 100)
    gateway = flow.ticket({}, body)  # checked (Pick, ext_proc), never admitted
    flow.finish(gateway, {"output_tokens": 5})
    assert flow.fairness.counters.get(ticket.tenant, 0.0) == 0.0  # type: ignore[attr-defined]
    flow.fairness.charge(ticket.tenant, ticket.estimate)  # as admit does
    ticket.admitted = True
    flow.finish(ticket, {"output_tokens": 5})
    assert flow.fairness.counters[ticket.tenant] == len(body) // 4 + 5  # type: ignore[attr-defined]
    flow.finish(ticket, {"output_tokens": 50})  # once only
    assert flow.fairness.counters[ticket.tenant] == len(body) // 4 + 5  # type: ignore[attr-defined]
