"""Request fields that belong to the router's handoff, never to its clients.

``kv_transfer_params`` and ``ec_transfer_params`` (vLLM's KV and encoder-cache
connectors) and SGLang's ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``
tell an engine where to pull or push KV blocks. Only the router may set them: from a
client they make an engine dial a host of the client's choice, or fail on a room nobody
opened. Every front end removes them from client bodies unless
``auth.allow_client_handoff_fields`` trusts the clients (a gateway or proxy of the
operator's that runs its own disaggregation).

They do not only sit at the top level of a body. vLLM 0.32 builds a request's
``SamplingParams.extra_args`` from ``vllm_xargs`` and, on ``/inference/v1/generate``,
takes ``sampling_params.extra_args`` from the client as it is; its engine then reads
``extra_args["kv_transfer_params"]`` and ``["ec_transfer_params"]``
(``vllm/v1/request.py``). :data:`OWNED_PATHS` lists every place one takes effect, and
:func:`strip_owned` is the one rule every front end applies.
"""

from __future__ import annotations

from typing import Any

#: vLLM's connector parameters (KV transfer, encoder-cache transfer).
_VLLM = ("kv_transfer_params", "ec_transfer_params")
#: SGLang's bootstrap fields.
_SGLANG = ("bootstrap_host", "bootstrap_port", "bootstrap_room")

ROUTER_OWNED: tuple[str, ...] = (*_VLLM, *_SGLANG)
"""The router-owned field names."""

#: Where a router-owned field takes effect: the object it sits in, and which names.
_CONTAINERS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    # Every engine's own request fields (vLLM's generation, render and Cohere routes,
    # SGLang's OpenAI and native routes).
    ((), ROUTER_OWNED),
    # vLLM: merged into SamplingParams.extra_args (completions, chat, responses, messages).
    (("vllm_xargs",), _VLLM),
    # vLLM /inference/v1/generate: SamplingParams.extra_args as the client sent it.
    (("sampling_params", "extra_args"), _VLLM),
    # An OpenAI SDK's extra_body sent as a field instead of merged: proxies and
    # engines that flatten it would apply what it holds.
    (("extra_body",), ROUTER_OWNED),
    (("extra_body", "vllm_xargs"), _VLLM),
)

OWNED_PATHS: tuple[tuple[str, ...], ...] = tuple(
    (*container, name) for container, names in _CONTAINERS for name in names
)
"""Every path of a router-owned field in a request body."""


def _container(payload: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any] | None:
    node: Any = payload
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def owned_fields(payload: dict[str, Any]) -> list[str]:
    """The router-owned fields a client body carries (usually none), as dotted paths
    (``kv_transfer_params``, ``sampling_params.extra_args.kv_transfer_params``)."""
    found = []
    for *container, name in OWNED_PATHS:
        node = _container(payload, tuple(container))
        if node is not None and name in node:
            found.append(".".join((*container, name)))
    return found


def strip_owned(payload: dict[str, Any]) -> list[str]:
    """Remove the router-owned fields from ``payload`` in place; returns their dotted
    paths (:func:`owned_fields`)."""
    found = []
    for *container, name in OWNED_PATHS:
        node = _container(payload, tuple(container))
        if node is not None and name in node:
            del node[name]
            found.append(".".join((*container, name)))
    return found
