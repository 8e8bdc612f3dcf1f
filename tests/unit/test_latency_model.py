"""The online latency model: fitted lines, priors, decay, and the load tracker feeding it."""

from __future__ import annotations

import random

import pytest

from router.fleet.latency import EngineLatency, LatencyModel, LatencyPriors, LineFit
from router.fleet.load import LoadTracker
from router.types import EngineKey

A = EngineKey("127.0.0.1:8000")
PRIORS = LatencyPriors(
    prefill_s_per_token=50e-6, ttft_overhead_s=0.02, prior_weight=8.0, half_life_s=60.0
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_new_engine_is_predicted_from_the_priors() -> None:
    fit = EngineLatency(PRIORS)
    assert fit.ttft_s(1000) == pytest.approx(0.02 + 1000 * 50e-6)
    assert fit.tpot_s(0) == pytest.approx(PRIORS.tpot_base_s)


def test_the_line_is_learnt_from_noisy_first_tokens() -> None:
    fit = EngineLatency(PRIORS)
    rng = random.Random(7)
    for i in range(400):
        tokens = rng.randint(0, 20_000)
        seconds = 0.005 + 120e-6 * tokens  # a slower engine than the priors say
        fit.observe_ttft(float(i) * 0.01, tokens, seconds * rng.uniform(0.9, 1.1))
    assert fit.prefill_s_per_token == pytest.approx(120e-6, rel=0.05)
    assert fit.ttft_overhead_s == pytest.approx(0.005, abs=0.02)
    assert fit.ttft.observations == 400


def test_an_engine_that_slows_down_is_noticed_within_a_few_half_lives() -> None:
    fit = EngineLatency(PRIORS)
    for i in range(300):  # five minutes at 50 µs per token
        fit.observe_ttft(float(i), 1000 + 10 * i, 0.01 + 50e-6 * (1000 + 10 * i))
    assert fit.prefill_s_per_token == pytest.approx(50e-6, rel=0.05)
    for i in range(300, 600):  # then it is three times slower
        fit.observe_ttft(float(i), 1000 + 10 * (i - 300), 0.01 + 150e-6 * (1000 + 10 * (i - 300)))
    # Noticed: most of the way there, the constant prior holding back the rest.
    assert fit.prefill_s_per_token == pytest.approx(150e-6, rel=0.2)


def test_coefficients_never_go_negative() -> None:
    fit = EngineLatency(PRIORS)
    for i in range(50):  # bigger prompts came back faster: no line through that is < 0
        fit.observe_ttft(float(i), 1000 * i, max(1.0 - 0.02 * i, 0.0))
    assert fit.prefill_s_per_token >= 0 and fit.ttft_overhead_s >= 0


def test_a_fit_with_no_spread_in_x_keeps_the_prior_slope() -> None:
    line = LineFit()
    line.solve(slope=2.0, intercept=1.0, prior_weight=0.0, prior_x=10.0)
    assert (line.slope, line.intercept) == (2.0, 1.0)


def test_new_priors_keep_what_was_learnt() -> None:
    model = LatencyModel(PRIORS)
    fit = model.of(A)
    for i in range(200):
        fit.observe_ttft(float(i), 500 * (i % 40), 0.003 + 80e-6 * 500 * (i % 40))
    learnt = fit.prefill_s_per_token
    model.reconfigure(LatencyPriors(prefill_s_per_token=10e-6, ttft_overhead_s=0.5))
    assert model.of(A) is fit and fit.ttft.observations == 200
    assert fit.prefill_s_per_token == pytest.approx(learnt, rel=0.1)


def test_the_tracker_times_first_tokens_against_the_queue_ahead() -> None:
    clock = Clock()
    tracker = LoadTracker(block_size=16, clock=clock, latency=LatencyModel(PRIORS))
    first = tracker.begin(A, prompt_tokens=4000, cached_tokens=0, max_tokens=10)
    second = tracker.begin(A, prompt_tokens=2000, cached_tokens=1000, max_tokens=10)
    assert (first.ahead, second.ahead) == (0, 4000)
    fit = tracker.view[A].latency
    assert fit is not None and fit is tracker.latency.of(A)  # type: ignore[union-attr]
    clock.now += 0.25
    tracker.prefilled(first)
    clock.now += 0.10
    tracker.prefilled(second)
    assert fit.ttft.observations == 2
    assert tracker.view[A].decoding == 2
    # The second waited for 4,000 queued tokens and prefilled 1,000 of its own in 0.35 s.
    assert fit.ttft._sx == pytest.approx(4000 + 5000, rel=1e-2)  # decayed by 0.1 s
    assert fit.ttft._sy == pytest.approx(0.25 + 0.35, rel=1e-2)
    second.output_tokens = 11
    clock.now += 1.0
    tracker.end(second)
    assert fit.tpot.observations == 1 and tracker.view[A].decoding == 1
    assert fit.tpot._sy == pytest.approx(1.0 / 10)


def test_a_decode_leg_and_an_unstreamed_answer_teach_nothing() -> None:
    clock = Clock()
    tracker = LoadTracker(block_size=16, clock=clock, latency=LatencyModel(PRIORS))
    leg = tracker.begin(A, 4000, 3999, 10, timed=False)
    whole = tracker.begin(A, 4000, 0, 10, sees_first_token=False)
    clock.now += 1
    tracker.prefilled(leg)
    tracker.prefilled(whole)
    fit = tracker.view[A].latency
    assert fit is not None and fit.ttft.observations == 0


def test_the_backlog_counts_what_is_left_of_work_in_progress() -> None:
    clock = Clock()
    tracker = LoadTracker(block_size=16, clock=clock, latency=LatencyModel(PRIORS))
    a = tracker.begin(A, 10_000, 0, 10)
    b = tracker.begin(A, 10_000, 0, 10)
    load = tracker.view[A]
    assert load.backlog_until == pytest.approx(clock.now + 2 * 10_000 * 50e-6)
    clock.now += 0.4  # the first came 0.1 s early: the second will too
    tracker.prefilled(a)
    assert load.backlog_until == pytest.approx(clock.now + 10_000 * 50e-6)
    clock.now += 0.2
    tracker.end(b)  # failed before its first token: nothing is queued any more
    assert load.backlog_until == clock.now


def test_a_request_that_leaves_the_queue_takes_only_its_own_share_of_the_backlog() -> None:
    clock = Clock()
    tracker = LoadTracker(block_size=16, clock=clock, latency=LatencyModel(PRIORS))
    t0 = clock.now
    tickets = [tracker.begin(A, 20_000, 0, 10) for _ in range(3)]  # 1 s of prefill each
    load = tracker.view[A]
    assert load.backlog_until == pytest.approx(t0 + 3.0)
    clock.now += 0.1
    tracker.end(tickets[1])  # the middle one leaves: 1 s less
    assert load.backlog_until == pytest.approx(t0 + 2.0)
    tracker.end(tickets[2])  # the last one: 1 s less again
    assert load.backlog_until == pytest.approx(t0 + 1.0)
