"""The parameters of the ``latency`` policy (router/policy/latency.py): the
``policy.latency`` section of the configuration, with the latency objectives it reads."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from router.config_section import Section

#: The smallest latency objective, in milliseconds (a microsecond): below it an
#: objective is no number a router can meet or compare against.
MIN_SLO_MS = 0.001


class SLOConfig(Section):
    """Latency objectives of a request (``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` override)."""

    ttft_ms: float | None = Field(
        None, ge=MIN_SLO_MS, le=86_400_000, description="Time to first token, ms."
    )
    tpot_ms: float | None = Field(
        None, ge=MIN_SLO_MS, le=86_400_000, description="Time per output token, ms."
    )


class LatencyPolicyConfig(Section):
    """The ``latency`` policy and the online latency model it reads (router/fleet/latency.py).

    The model's priors are what an engine is assumed to do before the router has timed
    it; the fitted lines replace them as first tokens and output pace are observed.
    """

    itl_weight: float = Field(
        1.0,
        ge=0,
        description="Cost, in seconds of this request's own wait, of one second it makes "
        "another request wait: the request's prefill time times the requests in flight on "
        "the engine (`harm_counts`), which share its steps (those queued) or have theirs "
        "lengthened (those decoding), is weighed by it. 1 counts everyone's time alike; "
        'higher trades TTFT for ITL tails (docs/simulator.md, "The latency policy").',
    )
    queue_model: Literal["backlog", "tokens"] = Field(
        "tokens",
        description="How the wait for queued prefill is predicted: `backlog` (each request "
        "sent extends the engine's predicted prefill backlog at its fitted speed; each first "
        "token re-anchors it, so work in progress counts what is left of it) or `tokens` "
        "(queued prefill tokens times the fitted speed, as kv_cost counts them).",
    )
    harm_counts: Literal["requests", "decoding"] = Field(
        "requests",
        description="Whose steps a prefill lengthens: `requests` (every request in flight "
        "there: those queued ahead decode by the time its chunks run) or `decoding` (only "
        "the sequences decoding now).",
    )
    idle_prefill_weight: float | None = Field(
        None,
        ge=0,
        description="The weight of the request's uncached prefill on an engine with nothing "
        "in flight from this router or its peers (null: as on any engine, 1 plus what it "
        "costs the requests arriving behind it, measured from the engine's recent load, "
        "which is 1 on an engine nobody has sent work to lately).",
    )
    slowdown_weight: float = Field(
        0.1,
        ge=0,
        description="Cost, in seconds of this request's own wait, of one second its decoding "
        "adds to the sequences decoding on the engine (its output tokens times the fitted "
        "seconds each sequence adds to a step, per sequence there). A tenth by default: a "
        "reader does not see a step a few percent longer as it sees a wait, and at higher "
        "weights the matrix's shared-prefix workloads lose hit rate (docs/architecture.md, "
        '"The default policy").',
    )
    tie_tolerance: float = Field(
        0.02,
        ge=0,
        le=1,
        description="Engines whose costs are within this share of the lowest are a tie "
        "(predictions of a few percent apart are within the latency model's error), broken "
        "toward the engine holding more of the prompt (the placement that costs the fleet "
        "the least compute), then fewer requests in flight, then the least recently routed.",
    )
    speed_tolerance: float = Field(
        1.0,
        ge=0,
        description="A fitted coefficient within a factor of 1 + this of the candidates' "
        "lower median counts as that median (fits of alike engines differ by noise); an "
        "engine further off (by default twice as slow, or fast) is priced at its own speed.",
    )
    prefill_us_per_token: float = Field(
        50.0, gt=0, description="Prior: microseconds of prefill per uncached prompt token."
    )
    ttft_overhead_ms: float = Field(
        20.0, ge=0, description="Prior: milliseconds to a first token with nothing to prefill."
    )
    tpot_base_ms: float = Field(
        10.0, ge=0, description="Prior: milliseconds per output token of a lone sequence."
    )
    tpot_us_per_seq: float = Field(
        200.0, ge=0, description="Prior: microseconds each other decoding sequence adds per token."
    )
    prior_weight: float = Field(
        8.0, gt=0, description="How many observations the priors are worth (they never decay)."
    )
    half_life_s: float = Field(
        60.0,
        gt=0,
        description="An observation weighs half as much after this many seconds (how fast "
        "an engine that slows down is noticed).",
    )
    slo: dict[str, SLOConfig] = Field(
        default_factory=dict,
        description='Default SLOs per model (`"*"`: every model); the request headers '
        "`x-slo-ttft-ms` and `x-slo-tpot-ms` override them.",
    )
    session_bonus_ms: float = Field(
        5.0,
        ge=0,
        description="Cost taken off the engine that served the request's session last "
        "(0: no session affinity in the cost).",
    )
    session_max_wait_ms: float = Field(
        1000.0,
        ge=0,
        description="The bonus shrinks by the predicted queue wait on that engine and is "
        "gone at this much: it never pulls a session onto a saturated engine.",
    )
    session_ttl_s: float = Field(
        600.0, gt=0, description="A session's engine is forgotten after this idle time."
    )
    max_sessions: int = Field(100_000, gt=0, description="Sessions remembered (LRU).")

    def slo_for(self, model: str) -> SLOConfig | None:
        """The default SLOs of ``model`` (its own entry, else ``*``)."""
        return self.slo.get(model) or self.slo.get("*")
