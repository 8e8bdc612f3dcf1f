"""Who a request is and how urgent: its flow-control ticket.

A ticket is built from what a front end has before planning: headers (or gRPC
metadata, or the gateway's ext_proc metadata), the API key, and a cheap look at the
body (``model``, ``user``, ``max_tokens``). Its token estimate (prompt bytes / 4 plus the
output budget) is what rate limits and the fairness counter charge at admission; the
answer's usage corrects it at the end (:meth:`router.flow.control.FlowControl.finish`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from router.security import bearer, key_digest

if TYPE_CHECKING:
    from router.flow.config import FlowConfig, FlowKeyConfig, FlowTenantConfig

PRIORITY_HEADER = "x-kvroute-priority"
TENANT_HEADER = "x-kvroute-tenant"
DEADLINE_HEADER = "x-kvroute-deadline-ms"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
"""The Gateway API Inference Extension's header naming a request's InferenceObjective."""
DEFAULT_TENANT = "default"
_TENANT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:@")


class _Peek(msgspec.Struct):
    """The few body fields flow control reads before the request is parsed."""

    model: str | None = None
    user: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    max_output_tokens: int | None = None
    n: int | None = None


_peek = msgspec.json.Decoder(_Peek).decode


@dataclass(slots=True, frozen=True)
class BodyFacts:
    """What a glance at a JSON body says (all optional: a body may be anything)."""

    model: str | None = None
    user: str | None = None
    prompt_tokens: int = 0
    output_tokens: int | None = None


def body_facts(body: bytes) -> BodyFacts:
    """``model``, ``user`` and the token estimate of a JSON request body (never raises)."""
    try:
        peek = _peek(body) if body else _Peek()
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        # Nesting past the interpreter's limit too: the front end's own decoding refuses
        # such a body with a 400 (``limits.max_json_depth``).
        return BodyFacts(prompt_tokens=len(body) // 4)
    output = peek.max_tokens or peek.max_completion_tokens or peek.max_output_tokens
    n = peek.n if isinstance(peek.n, int) and peek.n > 0 else 1
    return BodyFacts(
        peek.model, peek.user, len(body) // 4, output * n if output is not None else None
    )


def _tenant_name(value: str | None) -> str | None:
    """A client-given tenant, if usable as one (printable, at most 64 characters)."""
    if not value:
        return None
    value = value.strip()[:64]
    return value if value and set(value) <= _TENANT_CHARS else None


def _priority(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float) and math.isfinite(value):
        return max(-1000, min(1000, int(value)))
    if isinstance(value, str):
        try:
            return max(-1000, min(1000, int(value.strip())))
        except ValueError:
            return None
    return None


@dataclass(slots=True, eq=False)
class FlowTicket:
    """One request's identity and urgency in flow control."""

    tenant: str
    priority: int
    key: str | None = None
    """The ``flow.keys`` entry's name (or digest) of the request's API key, if it has one."""
    model: str | None = None
    deadline: float | None = None
    """When the caller gives up (``time.monotonic``): ``deadline`` ordering serves earlier
    ones first."""
    estimate: int = 0
    """Tokens charged at admission: prompt estimate plus the output budget."""
    prompt_estimate: int = 0
    """Of ``estimate``, the prompt's part."""
    waited_s: float = 0.0
    """Time spent in the admission queue."""
    charged: dict[str, int] = field(default_factory=dict)
    """Rate-limit bucket -> tokens charged to it so far (corrected at the end)."""
    finished: bool = False
    admitted: bool = False
    """It waited in the admission queue (HTTP, ``Generate``): fairness charged it."""
    yield_until: float | None = None
    """Prefill isolation (:mod:`router.flow.isolation`): until when it may wait for an
    outranking prefill to end; None: it has not had to."""
    yield_started: float | None = None
    yielded_s: float = 0.0
    """Time spent waiting for outranking prefills to end (after the admission queue)."""

    @property
    def sheddable(self) -> bool:
        return self.priority < 0

    def describe(self) -> str:
        """The queue's part of ``x-kvroute-reason``."""
        text = f"flow tenant={self.tenant} priority={self.priority} waited={self.waited_s:.3f}s"
        if self.yield_until is not None:
            text += f" yielded={self.yielded_s:.3f}s"
        return text


class Identities:
    """Turns a request's credentials and headers into a :class:`FlowTicket`."""

    def __init__(self, config: FlowConfig, default_max_tokens: int) -> None:
        self.config = config
        self.default_max_tokens = default_max_tokens
        self.keys: dict[str, FlowKeyConfig] = {k.key.get_secret_value(): k for k in config.keys}
        self.tenants: dict[str, FlowTenantConfig] = {t.name: t for t in config.tenants}
        self.by_name: dict[str, FlowKeyConfig] = {self.key_name(k): e for k, e in self.keys.items()}

    def key_name(self, key: str) -> str:
        entry = self.keys.get(key)
        return entry.name if entry is not None and entry.name else key_digest(key)

    def ticket(
        self,
        headers: Mapping[str, str],
        body: bytes = b"",
        *,
        metadata: Mapping[str, object] | None = None,
        deadline: float | None = None,
        now: float = 0.0,
    ) -> FlowTicket:
        """The ticket of a request with these (lower-case) ``headers`` and ``body``.

        ``metadata``: the gateway's flow metadata (ext_proc ``filter_metadata
        ["kvroute.flow"]``: ``priority``, ``tenant``); ``deadline``: the caller's own
        (gRPC); ``now``: ``time.monotonic()`` for ``x-kvroute-deadline-ms``.
        """
        cfg = self.config
        facts = body_facts(body)
        token = bearer(headers.get("authorization"))
        key = token.decode() if token is not None else (headers.get("x-api-key") or None)
        entry = self.keys.get(key) if key else None
        meta = metadata or {}
        tenant: str | None = _tenant_name(str(meta["tenant"])) if "tenant" in meta else None
        if tenant is None and key and entry is not None and not entry.may_set_tenant:
            # A client names its own header and body: a listed key's tenant binds it.
            tenant = self.key_name(key)
        for source in cfg.tenant_from:
            if tenant is not None:
                break
            if source == "header":
                tenant = _tenant_name(headers.get(TENANT_HEADER))
            elif source == "api_key" and key:
                tenant = self.key_name(key)
            elif source == "user":
                tenant = _tenant_name(facts.user)
        tenant = tenant or DEFAULT_TENANT
        limits = self.tenants.get(tenant)
        asked = _priority(meta.get("priority"))
        if asked is None:
            asked = _priority(headers.get(PRIORITY_HEADER))
            if asked is not None:
                asked = min(asked, cfg.max_priority)
        if asked is None and headers.get(OBJECTIVE_HEADER) in cfg.objectives:
            asked = cfg.objectives[headers[OBJECTIVE_HEADER]]
        if asked is not None and entry is not None and entry.max_priority is not None:
            asked = min(asked, entry.max_priority)
        priority = asked
        if priority is None and entry is not None:
            priority = entry.priority
        if priority is None and limits is not None:
            priority = limits.priority
        if priority is None:
            priority = cfg.default_priority
        budget = _priority_ms(headers.get(DEADLINE_HEADER))
        if budget is not None:
            mine = now + budget / 1000
            deadline = mine if deadline is None else min(deadline, mine)
        output = facts.output_tokens
        estimate = facts.prompt_tokens + (self.default_max_tokens if output is None else output)
        return FlowTicket(
            tenant=tenant,
            priority=priority,
            key=self.key_name(key) if entry is not None and key else None,
            model=facts.model,
            deadline=deadline,
            estimate=estimate,
            prompt_estimate=facts.prompt_tokens,
        )


def _priority_ms(value: str | None) -> float | None:
    if not value:
        return None
    try:
        ms = float(value)
    except ValueError:
        return None
    return ms if math.isfinite(ms) and ms >= 0 else None
