"""An engine's answer on its way to the caller: read whole, or relayed event by event.

Every server-sent event stream the router passes on goes through :func:`relay`: a
generation's (completions, chat, Messages, Responses, an engine route's stream), a
stored response's (``GET /v1/responses/{id}``) and the sidecar's. The relay finds the
stream's end at the engine (:func:`ends_stream`), lets a usage tap rewrite and an
answer watch see each chunk, and tells its :class:`RelayHooks` what happened; what the
callers differ in (load tickets, outcomes, the error a broken stream ends with) is in
their hooks. :func:`read_all` and :func:`first_chunk` are the other two ways an answer
is read, each telling the engine's :class:`Health` what it showed.
"""

from __future__ import annotations

import asyncio
import re
from typing import TYPE_CHECKING, Protocol

from router.http1 import HTTPError
from router.proxy import UpstreamError

if TYPE_CHECKING:
    from router.http1 import Response
    from router.proxy import Deadline, Deadlines, Upstream
    from router.serving.context import AnswerWatch
    from router.serving.downstream import Downstream
    from router.serving.usage import UsageTap

SSE_FIELDS = (b"data:", b":", b"event:", b"id:", b"retry:")
"""What an event of a server-sent event stream starts with."""
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
"""The head of a stream the router relays as its own answer."""
_STREAM_END = re.compile(
    rb"\n(?:data: ?\[DONE\]|event: ?(?:message_stop|response\.(?:completed|incomplete|failed)))"
)
"""The last event of an OpenAI, Anthropic or Responses stream, after a line break (a
JSON string holds no raw newline, so generated text cannot fake one)."""
_SEAM = 48
"""Bytes of the stream before a chunk searched with it: longer than any end marker."""


def ends_stream(before: bytes, chunk: bytes) -> bool:
    """Whether ``chunk`` holds the stream's last event, also when its marker began in
    ``before`` (what the stream sent before it; a line break for the first chunk)."""
    return _STREAM_END.search(before[-_SEAM:] + chunk) is not None


class Health(Protocol):
    """Told what an engine's answer showed of the engine (the registry's view)."""

    def failed(self) -> None:
        """The engine failed this request (counts toward ejecting it)."""

    def succeeded(self) -> None:
        """The engine answered this request."""


async def read_all(
    upstream: Upstream, response: Response, deadline: Deadline, url: str, health: Health | None
) -> bytes:
    """The rest of ``response``'s body; an :class:`UpstreamError` (``health`` told) if it
    breaks or times out."""
    try:
        return await upstream.read(response, deadline, url)
    except UpstreamError:
        if health is not None:
            health.failed()
        raise


async def first_chunk(response: Response, deadline: Deadline, health: Health | None) -> bytes:
    """The first bytes of a stream that must be server-sent events; an
    :class:`UpstreamError` (``health`` told, nothing sent to the client yet) when the
    stream breaks, ends or times out before them, or is something else."""
    try:
        first = await response.readany()
    except HTTPError as exc:
        if health is not None:
            health.failed()
        if deadline.expired:
            raise UpstreamError("timeout", "no first token in time", accepted=True) from None
        raise UpstreamError("protocol", f"the stream broke before its first byte: {exc}") from None
    if not first or not first.startswith(SSE_FIELDS):
        if health is not None:
            health.failed()
        if not first:
            raise UpstreamError("protocol", "the engine closed the stream without a byte")
        raise UpstreamError("protocol", "the engine's stream is not server-sent events")
    return first


class RelayHooks:
    """What one relay checks and tells; these defaults pass the engine's bytes as they
    come and tell nobody (a stored response's stream)."""

    checked = False
    """Whether the engine's bytes must be server-sent events: a chunk that starts an
    event with anything but a field breaks the stream (:data:`SSE_FIELDS`)."""

    def ended(self, events: int, tail: bytes) -> None:
        """The engine sent the stream's last event (in ``tail``), before the client has
        it; ``events``: the ``data:`` lines so far."""

    def finished(self, events: int, tail: bytes) -> None:
        """The engine's stream ended whole (``tail``: its last chunk), before its closing
        bytes are sent to the client."""

    def broke(self, exc: HTTPError) -> bytes | None:
        """The engine's stream broke, or timed out, after its head was sent: the events
        the client's stream ends with (None: it ends where it stopped)."""
        return None

    def gone_at_end(self) -> None:
        """The client left after it had the last event: the answer was whole."""


async def relay(
    deadlines: Deadlines,
    response: Response,
    deadline: Deadline,
    idle_timeout_s: float,
    sink: Downstream,
    head: dict[str, str],
    hooks: RelayHooks,
    *,
    first: bytes | None = None,
    tap: UsageTap | None = None,
    watch: AnswerWatch | None = None,
) -> bytes | None:
    """Relay ``response``'s event stream into ``sink`` (with ``head`` and the engine's
    status), chunk by chunk, each stamping ``deadline`` (silence longer than
    ``idle_timeout_s`` aborts it); ``tap`` may rewrite each chunk's usage, ``watch``
    sees it first.

    ``first``: the stream's first bytes, already read (:func:`first_chunk`): its end,
    if there, is found before the client has the head. Without it the head goes out
    before the engine's first bytes.

    Returns the stream's last chunk once it ended whole, None when it broke (the
    client's stream then ends with ``hooks.broke``'s events). A client that leaves
    raises :class:`asyncio.CancelledError`, after ``hooks.gone_at_end`` if it already
    had the last event.
    """
    stream = _Stream(hooks, watch)
    delivered = False  # the client has the last event, so the whole answer
    try:
        if first is not None:
            await stream.see(first)
        await sink.begin(response.status, head)
        if first is not None:
            await sink.write(tap.chunk(first) if tap is not None else first)
            delivered = stream.ended
        while chunk := await response.readany():
            deadlines.touch(deadline, idle_timeout_s)
            await stream.see(chunk)
            await sink.write(tap.chunk(chunk) if tap is not None else chunk)
            delivered = stream.ended
        hooks.finished(stream.events, stream.tail)
        await sink.end()
    except asyncio.CancelledError:
        if delivered:
            hooks.gone_at_end()
        raise
    except HTTPError as exc:
        closing = hooks.broke(exc)
        if closing:
            await sink.write(closing)
        await sink.end()
        return None
    return stream.tail


class _Stream:
    """What a relay has seen of one stream: its events, whether it ended, its last
    chunk."""

    __slots__ = ("ended", "events", "hooks", "tail", "watch")

    def __init__(self, hooks: RelayHooks, watch: AnswerWatch | None) -> None:
        self.hooks = hooks
        self.watch = watch
        self.events = 0  # about one token each: the pace the load model learns
        self.ended = False
        self.tail = b"\n"

    async def see(self, chunk: bytes) -> None:
        """Take in the next chunk, before it is written to the client."""
        self.events += chunk.count(b"data:")
        # An event starts where the last one ended: it must start with a field.
        if self.hooks.checked and self.tail.endswith(b"\n\n") and not chunk.startswith(SSE_FIELDS):
            raise HTTPError(
                "the engine sent bytes that are not server-sent events", before_response=False
            )
        if self.watch is not None:
            await self.watch.chunk(chunk)
        if not self.ended and ends_stream(self.tail, chunk):
            self.ended = True
            self.hooks.ended(self.events, chunk)
        self.tail = chunk
