"""Request fields that belong to the router's handoff, never to its clients.

``kv_transfer_params`` (vLLM's KV connectors) and SGLang's ``bootstrap_host``,
``bootstrap_port`` and ``bootstrap_room`` tell an engine where to pull or push KV
blocks. Only the router may set them: from a client they make an engine dial a host of
the client's choice, or fail on a room nobody opened. Every front end removes them
from client bodies unless ``auth.allow_client_handoff_fields`` trusts the clients (a
gateway or proxy of the operator's that runs its own disaggregation).
"""

from __future__ import annotations

from typing import Any

ROUTER_OWNED: tuple[str, ...] = (
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
)


def owned_fields(payload: dict[str, Any]) -> list[str]:
    """The router-owned fields a client body carries (usually none)."""
    return [name for name in ROUTER_OWNED if name in payload]


def strip_owned(payload: dict[str, Any]) -> list[str]:
    """Remove the router-owned fields from ``payload`` in place; returns their names."""
    found = owned_fields(payload)
    for name in found:
        del payload[name]
    return found
