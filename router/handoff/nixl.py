"""vLLM's NixlConnector dialect (pull): build both legs, read what the prefill returns.

* Prefill leg: the client's body with ``stream: false``, ``max_tokens: 1`` (and
  ``max_completion_tokens: 1`` if present), ``stream_options`` and ``min_tokens``
  removed, and ``kv_transfer_params`` asking for a remote decode. Same ``X-Request-Id``.
* The prefill answer carries ``kv_transfer_params`` (``do_remote_prefill``,
  ``remote_engine_id``, ``remote_block_ids``, ``remote_request_id``, ``remote_host``,
  ``remote_port``, ``tp_size``, ...) only when it finished length-capped. They are
  opaque: every field goes to the decode leg verbatim.
* Decode leg: the client's body (streaming as the client asked) plus those params.

``remote_host``/``remote_port`` name the prefill engine's NIXL side channel, not its
HTTP port; a loopback host is unreachable from another machine whatever a proxy
writes, so it is warned about and rewritten only when configured (never the port).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any

REMOTE_DECODE_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(payload: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: one token, not streamed, asking for a remote decode."""
    body = dict(payload)
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body.pop("stream_options", None)
    body.pop("min_tokens", None)
    body["kv_transfer_params"] = dict(REMOTE_DECODE_PARAMS)
    return body


def returned_params(answer: Mapping[str, Any]) -> dict[str, Any] | None:
    """The params a prefill answer hands to the decode leg, if it gave usable ones."""
    params = answer.get("kv_transfer_params")
    if isinstance(params, dict) and params.get("do_remote_prefill"):
        return params
    return None


def decode_body(payload: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The decode leg's body: the client's request plus the params, copied verbatim."""
    body = dict(payload)
    body["kv_transfer_params"] = dict(params)
    return body


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_remote_host(
    params: dict[str, Any], engine_host: str, rewrite: bool
) -> tuple[dict[str, Any], bool]:
    """Flag (and optionally fix) a loopback ``remote_host`` from a non-loopback engine.

    Returns the params (rewritten only when ``rewrite``) and whether they needed it.
    """
    host = params.get("remote_host")
    if not isinstance(host, str) or not is_loopback(host) or is_loopback(engine_host):
        return params, False
    if rewrite:
        params = {**params, "remote_host": engine_host}
    return params, True


def cached_tokens(answer: Mapping[str, Any]) -> int | None:
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    value = details.get("cached_tokens")
    return value if isinstance(value, int) else None


def recomputed(decode_cached: int | None, prompt_tokens: int, block_size: int) -> bool:
    """Whether a decode leg prefilled locally instead of using the pulled KV.

    A pulled prompt counts as cached except its last token; vLLM (and the emulator) log
    a failed pull and recompute, which shows as a decode leg with (almost) nothing
    cached. One block of slack covers how engines round.
    """
    return decode_cached is not None and decode_cached < prompt_tokens - block_size - 1
