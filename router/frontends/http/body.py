"""Reading a client's request body: the size limit, then its ``Content-Encoding``.

aiohttp's own decompression is off (``auto_decompress=False`` on every listener): it
inflates a whole chunk before any limit is checked (a 200 KB gzip bomb cost 160 MB) and
answers an undecodable body with an exception. Here a body is inflated in steps of at
most what the limit still allows, so a bomb costs at most ``limit`` bytes before its
413, and a body that does not decode is a 400. Accepted codings: ``gzip`` (``x-gzip``),
``deflate`` (zlib-wrapped or raw, as clients send both) and ``identity``, in any
sequence (``Content-Encoding: gzip, deflate`` is undone last to first).
"""

from __future__ import annotations

import zlib

from aiohttp import web

from router.serving.errors import ApiError, bad_request

#: zlib ``wbits`` per coding (``deflate`` is resolved per body, see :func:`_deflate_wbits`).
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS}
_STEP = 1 << 18
"""Most output bytes one inflate call makes (zlib grows its buffer by copying)."""


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than {limit} bytes")


async def read_body(request: web.Request) -> bytes:
    """The request's body, decoded, at most the application's ``client_max_size`` bytes
    (413) before and after decoding; 400 for a coding that is not accepted or a body
    that does not decode."""
    limit = request.client_max_size
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large(limit) from None
    return decode_content(body, request.headers.get("Content-Encoding", ""), limit)


def decode_content(body: bytes, encoding: str, limit: int) -> bytes:
    """``body`` with the codings of a ``Content-Encoding`` value undone, bounded by
    ``limit`` bytes of output."""
    codings = [c.strip().lower() for c in encoding.split(",") if c.strip()]
    for coding in reversed(codings):
        if coding == "identity":
            continue
        if coding == "deflate":
            body = _inflate(body, _deflate_wbits(body), limit, coding)
        elif coding in _WBITS:
            body = _inflate(body, _WBITS[coding], limit, coding)
        else:
            raise ApiError(
                400,
                f"Content-Encoding {coding[:40]!r} is not accepted (gzip, deflate or identity)",
                param="Content-Encoding",
            )
    return body


def _deflate_wbits(body: bytes) -> int:
    """zlib-wrapped if the body starts with a zlib header, else raw deflate."""
    if len(body) >= 2 and body[0] & 0x0F == 8 and (body[0] << 8 | body[1]) % 31 == 0:
        return zlib.MAX_WBITS
    return -zlib.MAX_WBITS


def _inflate(data: bytes, wbits: int, limit: int, coding: str) -> bytes:
    """Inflate ``data`` (every gzip member of it) without ever holding more than
    ``limit`` + 1 output bytes."""
    out: list[bytes] = []
    size = 0
    while True:
        inflater = zlib.decompressobj(wbits)
        pending = data
        try:
            while pending and not inflater.eof:
                chunk = inflater.decompress(pending, min(_STEP, limit + 1 - size))
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                out.append(chunk)
                pending = inflater.unconsumed_tail
        except zlib.error as exc:
            raise bad_request(f"request body is not valid {coding}: {exc}") from None
        if not inflater.eof:
            raise bad_request(f"request body is not valid {coding}: it ends early")
        data = inflater.unused_data
        if not data or wbits != _WBITS["gzip"]:
            return b"".join(out)
