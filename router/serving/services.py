"""What the front ends use of the router: the HTTP API, gRPC ``Pick``/``Generate``/
``Admin`` and ext_proc receive a :class:`Services`, not the :class:`~router.app.RouterApp`.

Every piece is built by the application (``RouterApp.services``); the front ends read
nothing else of it. Pieces that change while the router runs are read through their
owner: the configuration through the live configuration, the drain state through
:class:`RunState`, and the upstream client, which exists once the router has started.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router.serving.owned import OwnedFields

if TYPE_CHECKING:
    from router.admin import Admin
    from router.admission import Admission
    from router.config import Config
    from router.core import RoutingCore
    from router.fleet.registry import Registry
    from router.flow.control import FlowControl
    from router.live_config import LiveConfig
    from router.metrics import RouterMetrics
    from router.proxy import Upstream
    from router.response_store import ResponseStore
    from router.security import Credentials
    from router.serving.decide import Decider
    from router.serving.gate import Gate
    from router.serving.picks import PickLedger
    from router.tokenization import Tokenizers


@dataclass(slots=True)
class RunState:
    """Whether the router is draining, and since when it serves."""

    draining: bool = False
    started_at: float = field(default_factory=time.time)


@dataclass(slots=True, eq=False)
class Services:
    """The pieces a front end uses, and nothing else of the application."""

    live: LiveConfig
    registry: Registry
    core: RoutingCore
    decider: Decider
    admission: Admission
    metrics: RouterMetrics
    tokenizers: Tokenizers
    credentials: Credentials
    picks: PickLedger
    admin: Admin
    block_size_for: Callable[[str], int]
    state: RunState
    responses: ResponseStore
    """Which engine holds each Responses API response (``previous_response_id``)."""
    gate: Gate
    """Admission (:mod:`router.serving.gate`): the FIFO queue's, or flow control's."""
    upstream: Upstream | None = None
    """The client to engines; set when the router starts (before it serves)."""
    flow: FlowControl | None = None
    """Priority bands, fairness, rate limits and shedding (``flow.enabled``); None: the
    plain admission queue."""

    @property
    def config(self) -> Config:
        """The configuration in force (it changes on reload)."""
        return self.live.current

    @property
    def draining(self) -> bool:
        return self.state.draining

    @property
    def owned(self) -> OwnedFields:
        """The router-owned fields rule (:mod:`router.serving.owned`) for the
        configuration in force, counting each field it takes out in
        ``kvroute_client_handoff_fields_removed_total``."""
        removed = self.metrics.handoff_fields_removed
        return OwnedFields(
            self.config.auth.allow_client_handoff_fields,
            lambda path: removed.labels(path).inc(),
        )

    @property
    def started_at(self) -> float:
        return self.state.started_at
