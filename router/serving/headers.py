"""Client headers the router reads or forwards: printable ASCII, credentials once, or a
400.

aiohttp hands header bytes over as UTF-8 with surrogate escapes, gRPC ``Generate``'s
``headers`` map as any Unicode; neither can be put on an HTTP/1.1 line to an engine or
compared as a key. Checked where they enter, before anything is routed: the value is
either visible ASCII, spaces and tabs, or the request is refused as the client's
mistake.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping

from router.serving.errors import ApiError

_PRINTABLE = re.compile(r"[\t\x20-\x7e]*")
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")
"""What a request id may look like (it goes into headers and logs)."""

#: Latency objectives of a request (llm-d's names), in milliseconds.
SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TPOT_HEADER = "x-slo-tpot-ms"

#: Headers the router reads itself or forwards to engines.
CLIENT_HEADERS = (
    "authorization",
    "x-api-key",
    "x-session-id",
    "x-request-id",
    "x-data-parallel-rank",
    SLO_TTFT_HEADER,
    SLO_TPOT_HEADER,
)


#: Credentials a request may carry once: of two, the router would read one and a proxy
#: in front of it (or the engine behind) perhaps the other.
SINGLE_HEADERS = ("authorization", "x-api-key")


def repeated(names: Iterable[str]) -> str | None:
    """The first of :data:`SINGLE_HEADERS` that ``names`` (lower-case, one per header
    line or metadata entry) holds more than once."""
    counts = Counter(name for name in names if name in SINGLE_HEADERS)
    return next((name for name in SINGLE_HEADERS if counts[name] > 1), None)


def check_single(names: Iterable[str]) -> None:
    """Each of :data:`SINGLE_HEADERS` at most once among ``names``, else 400."""
    name = repeated(names)
    if name is not None:
        raise ApiError(400, f"header {name} was sent more than once; send it once", param=name)


def header(headers: Mapping[str, str], name: str) -> str | None:
    """``headers[name]`` if present; 400 if it is not printable ASCII."""
    value = headers.get(name)
    if value is not None and not _PRINTABLE.fullmatch(value):
        raise ApiError(400, f"header {name} must be printable ASCII", param=name)
    return value


def check_headers(headers: Mapping[str, str]) -> None:
    """Every one of :data:`CLIENT_HEADERS` present is printable ASCII, and those of
    :data:`SINGLE_HEADERS` come once (else 400)."""
    # An HTTP request's headers are a multidict: its items() repeat a repeated name.
    check_single(name.lower() for name, _ in headers.items())
    for name in CLIENT_HEADERS:
        header(headers, name)
