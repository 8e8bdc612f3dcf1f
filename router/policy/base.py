"""What every routing policy sees and returns.

A policy is a pure choice: given a request's block keys, the candidates, each
candidate's match depth from the index and the load view, it returns a
:class:`Decision` that carries the reason with its numbers. Policies never touch the
network; the HTTP, gRPC and ext_proc servers and the simulator all call the same ones.
Random choices use an RNG seeded from the request id, so the same request and state
give the same choice on every API.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import msgspec
import xxhash

from router.fleet.load import LoadView
from router.index.base import Match
from router.types import EngineKey

if TYPE_CHECKING:
    from router.flow.ticket import FlowTicket
    from router.policy.registry import PolicyConfig


@dataclass(slots=True)
class RouteRequest:
    """The routing-relevant facts of one request."""

    request_id: str
    keys: Sequence[int]
    """Chained block keys of the prompt's full blocks."""
    prompt_tokens: int
    block_size: int
    max_tokens: int = 0
    session: str | None = None
    """Affinity key for the ``session`` policy (header or ``user`` field)."""
    approximate: bool = False
    """Keys come from an approximate tokenizer: no KV event will ever confirm them."""
    wait_until: float | None = None
    """When every candidate is at its in-flight limit, wait for room until this
    ``time.monotonic()``; None: fail at once (429 / RESOURCE_EXHAUSTED)."""
    transfer_tokens: Mapping[EngineKey, float] | None = None
    """Prefill choice with engine topology known: per candidate, what moving the KV to
    the chosen decode engine costs, in prompt tokens' worth of prefill (transfer seconds
    over ``disaggregation.prefill_s_per_token``). Cost policies add it to the
    candidate's prefill; None: every link alike (no topology)."""
    transfer_s_per_token: float | None = None
    """What one of ``transfer_tokens`` is in seconds (``disaggregation.prefill_s_per_token``):
    the ``latency`` policy prices the transfer in seconds."""
    slo_ttft_s: float | None = None
    """Time-to-first-token objective (``x-slo-ttft-ms`` or the model's default); the
    ``latency`` policy prefers engines predicted to meet it."""
    slo_tpot_s: float | None = None
    """Time-per-output-token objective (``x-slo-tpot-ms`` or the model's default)."""
    flow: FlowTicket | None = None
    """The request's flow-control ticket (``flow.enabled``): with prefill isolation on,
    engines prefilling requests that outrank it are left out (:mod:`router.flow.isolation`)."""
    by_load: bool = False
    """Nothing of the request was hashed (a pass-through body, count_tokens, a GET through
    a gateway): the choice is the load's, and its reason says ``load``, not ``no_prefix``
    (no lookup was made that could have found nothing)."""


class Score(msgspec.Struct, gc=False):
    """One candidate's cost terms under a cost-based policy (lower total wins)."""

    engine: EngineKey
    matched_blocks: int
    cached_tokens: int
    queue: float
    prefill: float
    decode: float
    reported: float
    total: float
    transfer: float = 0.0
    """The KV transfer to the decode engine, in blocks like ``prefill`` (a prefill
    engine's choice with topology known; included in ``total``)."""
    ttft: float = 0.0
    """``latency`` policy: predicted seconds to the first token there (every term of
    that policy is in seconds, not blocks)."""
    harm: float = 0.0
    """``latency`` policy: the weighted inter-token latency its prefill costs the
    sequences decoding there (included in ``total``)."""
    tpot: float = 0.0
    """``latency`` policy: predicted seconds per output token there."""
    bonus: float = 0.0
    """``latency`` policy: the session-affinity bonus taken off ``total``."""


class LazyScores(Sequence[Score]):
    """Candidates' scores made when first read: a policy that chose from its cost terms
    in flat arrays (:func:`router._native.kv_cost_scan`) hands the decision this instead
    of a list, so a request nobody inspects the scores of (most HTTP requests) never
    pays a ``Score`` object per candidate. Reads as the list it stands for."""

    __slots__ = ("_items", "_len", "_make")

    def __init__(self, make: Callable[[], list[Score]], length: int) -> None:
        self._make: Callable[[], list[Score]] | None = make
        self._items: list[Score] | None = None
        self._len = length

    def _list(self) -> list[Score]:
        if self._items is None:
            assert self._make is not None
            self._items = self._make()
            self._make = None
        return self._items

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index):  # type: ignore[no-untyped-def,override]
        return self._list()[index]

    def __iter__(self) -> Iterator[Score]:
        return iter(self._list())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyScores):
            other = other._list()
        return self._list() == other

    __hash__ = None  # type: ignore[assignment]  # a list's equality, unhashable as a list

    def __repr__(self) -> str:
        return repr(self._list())


@dataclass(slots=True)
class Decision:
    """The chosen engine and why."""

    engine: EngineKey
    policy: str
    reason: str
    """Short machine-friendly reason code, e.g. ``lowest_cost``, ``balance``."""
    matched_blocks: int = 0
    cached_tokens: int = 0
    """Prompt tokens the chosen engine is expected to serve from cache."""
    scores: Sequence[Score] = field(default_factory=list)
    """Every candidate's cost terms, in candidate order (a list, or :class:`LazyScores`
    that makes them when read)."""
    index: str = ""
    """How the index lookup went when it did not answer itself: ``shadow:<why>`` (from
    the router's recent decisions) or ``skipped:<why>``; ``why`` is ``over_budget``,
    ``unreachable``, ``refused`` or ``unavailable``. Empty when the index answered."""
    note: str = ""
    """What the plan adds to the reason (the prefill/decode link with topology known)."""
    chosen_score: Score | None = None
    """The chosen engine's entry of ``scores``, when the policy kept it (else
    :meth:`chosen_terms` looks for it)."""

    def chosen_terms(self) -> Score | None:
        """The chosen engine's cost terms, if the policy scored it."""
        score = self.chosen_score
        if score is not None and score.engine == self.engine:
            return score
        return next((s for s in self.scores if s.engine == self.engine), None)

    def summary(self) -> str:
        """One line for the ``x-kvroute-reason`` header (and the access log)."""
        text = f"{self.policy}:{self.reason} match={self.matched_blocks}"
        if self.index:
            text += f" index={self.index}"
        chosen = self.chosen_terms()
        if chosen is not None and self.policy == "latency":
            text += " " + latency_terms(chosen)
        elif chosen is not None:
            text += (
                f" cost={chosen.total:.1f} queue={chosen.queue:.1f}"
                f" prefill={chosen.prefill:.1f} decode={chosen.decode:.1f}"
            )
            if chosen.transfer:
                text += f" transfer={chosen.transfer:.1f}"
        if self.note:
            text += f" {self.note}"
        return text

    def describe(self) -> str:
        """Every candidate's numbers, for the debug log."""
        parts = [f"{self.summary()} engine={self.engine.label}"]
        for s in sorted(self.scores, key=lambda s: s.total):
            if self.policy == "latency":
                parts.append(
                    f"{s.engine.label}[match={s.matched_blocks} cached={s.cached_tokens}"
                    f" {latency_terms(s)}]"
                )
                continue
            parts.append(
                f"{s.engine.label}[match={s.matched_blocks} cached={s.cached_tokens}"
                f" queue={s.queue:.1f} prefill={s.prefill:.1f} decode={s.decode:.1f}"
                f" reported={s.reported:.1f}"
                + (f" transfer={s.transfer:.1f}" if s.transfer else "")
                + f" total={s.total:.1f}]"
            )
        return " ".join(parts)


def latency_terms(s: Score) -> str:
    """A ``latency`` policy score's terms, in milliseconds."""
    text = (
        f"cost={s.total * 1e3:.1f}ms ttft={s.ttft * 1e3:.1f}ms queue={s.queue * 1e3:.1f}ms"
        f" prefill={s.prefill * 1e3:.1f}ms decode={s.decode * 1e3:.1f}ms"
        f" harm={s.harm * 1e3:.1f}ms tpot={s.tpot * 1e3:.1f}ms"
    )
    if s.reported:
        text += f" reported={s.reported * 1e3:.1f}ms"
    if s.transfer:
        text += f" transfer={s.transfer * 1e3:.1f}ms"
    if s.bonus:
        text += f" session=-{s.bonus * 1e3:.1f}ms"
    return text


def request_seed(request_id: str) -> int:
    return xxhash.xxh3_64_intdigest(request_id.encode("utf-8", "surrogatepass"))


def request_rng(request_id: str) -> random.Random:
    """An RNG whose draws depend only on the request id."""
    return random.Random(request_seed(request_id))


def tiebreak(request_id: str, engine: EngineKey) -> int:
    """A pseudo-random rank of ``engine`` for this request, for breaking ties."""
    return xxhash.xxh3_64_intdigest(f"{request_id}\x00{engine.label}".encode())


class NoCandidates(LookupError):
    """No engine can take the request (the API turns this into 503)."""


class Policy(ABC):
    """A named routing policy."""

    name: ClassVar[str]
    uses_index: ClassVar[bool] = False
    """Whether the router must look the request's keys up before calling ``choose``."""

    @abstractmethod
    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[EngineKey],
        matches: Mapping[EngineKey, Match],
        loads: LoadView,
    ) -> Decision:
        """Pick one of ``candidates`` (never empty)."""

    @classmethod
    def from_config(cls, config: PolicyConfig, clock: Callable[[], float]) -> Policy:
        """Build the policy from the ``policy`` section (a policy with parameters reads
        its own field of it); a policy without any takes none."""
        return cls()

    def forget(self, engine: EngineKey) -> None:  # noqa: B027 - stateless policies ignore it
        """Drop any state about an engine that left the fleet."""

    def moved(self, request: RouteRequest, engine: EngineKey) -> None:  # noqa: B027
        """A gateway served ``request`` on ``engine``, not on the one chosen (a fallback):
        what the policy remembers of its choice should say ``engine`` (stateless
        policies ignore it)."""
