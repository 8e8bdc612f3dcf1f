"""Errors in the OpenAI API's own form.

Every error the router returns is ``{"error": {"message", "type", "code", "param"}}``
with one of the documented statuses; an error after the first streamed byte is an SSE
``data: {"error": ...}`` event followed by ``data: [DONE]``.
"""

from __future__ import annotations

import msgspec

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}

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


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)
