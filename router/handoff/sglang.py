"""SGLang's bootstrap dialect (push): one pair chosen up front, both legs at once.

The router adds ``bootstrap_host`` and ``bootstrap_port`` (the prefill engine's
bootstrap listener) and ``bootstrap_room`` (a random 63-bit integer naming the pair) to
the same body, sends it to the prefill and the decode engine concurrently, returns the
decode engine's answer and discards the prefill's. If one leg fails, the other is
cancelled.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any


def new_room(rng: random.Random) -> int:
    return rng.getrandbits(63)


def with_bootstrap(payload: Mapping[str, Any], host: str, port: int, room: int) -> dict[str, Any]:
    body = dict(payload)
    body["bootstrap_host"] = host
    body["bootstrap_port"] = port
    body["bootstrap_room"] = room
    return body
