"""Errors in the form of the API a client called.

Every error the router returns is ``{"error": {"message", "type", "code", "param"}}``
with one of the documented statuses; an error after the first streamed byte is an SSE
``data: {"error": ...}`` event followed by ``data: [DONE]``. On the Anthropic Messages
routes (:func:`anthropic_route`) the same error is ``{"type": "error", "error": {"type",
"message"}}`` with Anthropic's type names, and mid-stream an ``event: error`` event
(:func:`shape_for` picks the form by path).
"""

from __future__ import annotations

import msgspec

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "request_timeout",
    413: "request_too_large",
    429: "rate_limit_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}

#: Anthropic's error types (https://docs.anthropic.com/en/api/errors) by status.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
ANTHROPIC_PATH = "/v1/messages"
"""The Anthropic Messages routes: this path and every path under it."""

_encode = msgspec.json.Encoder().encode


class ApiError(Exception):
    """An error to answer in OpenAI's form."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "api_error")

    def payload(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code or self.status,
            }
        }

    def body(self) -> bytes:
        return _encode(self.payload())

    def sse(self) -> bytes:
        """The error as the last events of a stream that has already started."""
        return b"data: " + self.body() + b"\n\ndata: [DONE]\n\n"


class Draining(ApiError):
    """503: the router is shutting down (every front end, before anything else)."""

    def __init__(self) -> None:
        super().__init__(503, "the router is shutting down", retry_after=1)


class TooManyInFlight(ApiError):
    """429: ``limits.max_inflight`` requests are on the engines (the front ends that do
    not wait: gRPC ``Pick``, ext_proc)."""

    def __init__(self) -> None:
        super().__init__(429, "too many requests in flight", retry_after=1)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def anthropic_route(path: str) -> bool:
    """Whether ``path`` is one of the Anthropic Messages routes."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


class ErrorShape:
    """How one API writes an error: OpenAI's form (this class) or Anthropic's."""

    def body(self, err: ApiError) -> bytes:
        return err.body()

    def sse(self, err: ApiError) -> bytes:
        return err.sse()


class AnthropicErrorShape(ErrorShape):
    """``{"type": "error", "error": {"type", "message"}}``; mid-stream an ``error`` event
    (Anthropic's stream has no ``[DONE]``)."""

    def payload(self, err: ApiError) -> dict[str, object]:
        kind = _ANTHROPIC_TYPES.get(err.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": err.message}}

    def body(self, err: ApiError) -> bytes:
        return _encode(self.payload(err))

    def sse(self, err: ApiError) -> bytes:
        return b"event: error\ndata: " + self.body(err) + b"\n\n"


OPENAI_SHAPE = ErrorShape()
ANTHROPIC_SHAPE = AnthropicErrorShape()


def shape_for(path: str) -> ErrorShape:
    """The error form of the API served at ``path``."""
    return ANTHROPIC_SHAPE if anthropic_route(path) else OPENAI_SHAPE
