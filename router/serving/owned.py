"""The router-owned fields rule: what every front end does with a client body that
carries the router's handoff fields (:mod:`router.handoff.fields` says which and where).

A front end that forwards the body itself (HTTP, passthrough routes, Anthropic's
``count_tokens``, gRPC ``Generate``, the sidecar, ext_proc before any chunk went on)
takes them out and counts each in ``kvroute_client_handoff_fields_removed_total``; one
that cannot change what is forwarded (gRPC ``Pick`` with a body its caller sends, ext_proc
once earlier chunks have gone to the engine) refuses the request with a 400 naming the
first field. ``auth.allow_client_handoff_fields`` (the sidecar's
``--allow-client-handoff-fields``) trusts the clients: bodies then go on as they came.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from router.handoff.fields import owned_fields, strip_owned
from router.serving.errors import ApiError
from router.serving.parsing import decode_body

_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class OwnedFields:
    """The rule as one front end applies it, for the configuration in force."""

    trusted: bool = False
    """Clients may send the fields (``auth.allow_client_handoff_fields``)."""
    removed: Callable[[str], None] | None = None
    """Called with the dotted path of each field taken out (the metric's label)."""

    def strip(self, payload: dict[str, Any]) -> bool:
        """Take the fields out of ``payload`` in place; True if any was (the body must
        then be encoded again)."""
        if self.trusted:
            return False
        found = strip_owned(payload)
        if self.removed is not None:
            for path in found:
                self.removed(path)
        return bool(found)

    def refuse(self, payload: dict[str, Any], remedy: str = "a client may not send them") -> None:
        """Raise a 400 naming the fields ``payload`` carries, for a body the router
        cannot change; ``remedy`` ends the message."""
        if self.trusted:
            return
        found = owned_fields(payload)
        if found:
            raise ApiError(
                400, f"the router sets {', '.join(found)} itself; {remedy}", param=found[0]
            )

    def body(self, body: bytes, max_depth: int = 32) -> tuple[bytes, dict[str, Any]]:
        """Decode a client's JSON body (:func:`~router.serving.parsing.decode_body`: 400 for
        anything but a JSON object) and take the fields out: the bytes to forward (the
        same bytes when nothing was removed) and the request they carry."""
        payload = decode_body(body, max_depth)
        if self.strip(payload):
            body = _encode(payload)
        return body, payload
