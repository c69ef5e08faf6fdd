"""Error envelopes: OpenAI's `{"error": {"message", "type", "param", "code"}}`,
and Anthropic's `{"type": "error", "error": {"type", "message"}}` for the
Messages API's routes (`is_anthropic_path`).

An error the server did not expect is a 500 whose message says only that:
its traceback goes to the server log, never to the client."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from starlette.responses import Response

from ferrox.common.errors import (
    ContextLengthExceededError,
    EngineDeadError,
    InvalidArgumentError,
    RequestTimeoutError,
    ServerBusyError,
)

logger = logging.getLogger("ferrox.server")


class HTTPLimitError(Exception):
    """A request beyond one of the server's HTTP limits (body size...)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> Response:
    body = msgspec.json.encode(error_body(status, message, param=param, code=code))
    return Response(body, status_code=status, media_type="application/json")


def describe(exc: BaseException) -> tuple[int, str, str | None, str | None]:
    """(status, message, param, code) of an exception raised while serving."""
    if isinstance(exc, EngineDeadError):
        return 503, f"the engine stopped: {exc}", None, "engine_dead"
    if isinstance(exc, HTTPLimitError):
        return exc.status, str(exc), None, exc.code
    if isinstance(exc, ServerBusyError):
        return 503, str(exc), None, "server_busy"
    if isinstance(exc, RequestTimeoutError):
        return 408, str(exc), None, "request_timeout"
    if isinstance(exc, ContextLengthExceededError):
        return 400, str(exc), getattr(exc, "param", None), "context_length_exceeded"
    if isinstance(exc, InvalidArgumentError | ValueError):
        return 400, str(exc), getattr(exc, "param", None), getattr(exc, "code", None)
    logger.error("internal error while serving a request", exc_info=exc)
    return 500, "internal error (the server log has the details)", None, "internal_error"


def exception_response(exc: BaseException) -> Response:
    status, message, param, code = describe(exc)
    response = error_response(status, message, param=param, code=code)
    if isinstance(exc, ServerBusyError):
        response.headers["Retry-After"] = str(exc.retry_after)
    return response


def sse_error(exc: BaseException) -> bytes:
    """An error event for a stream that already started, then the end marker."""
    status, message, param, code = describe(exc)
    body = msgspec.json.encode(error_body(status, message, param=param, code=code))
    return b"data: " + body + b"\n\ndata: [DONE]\n\n"


# ---- Anthropic's shape -----------------------------------------------------------

ANTHROPIC_OVERLOADED = 529  # Anthropic's status for "busy, retry later"
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    ANTHROPIC_OVERLOADED: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    """The Messages API's routes, whose errors take Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error_response(status: int, message: str) -> Response:
    body = msgspec.json.encode(anthropic_error_body(status, message))
    return Response(body, status_code=status, media_type="application/json")


def _anthropic_describe(exc: BaseException) -> tuple[int, str]:
    status, message, _, _ = describe(exc)
    if isinstance(exc, ServerBusyError):
        status = ANTHROPIC_OVERLOADED
    return status, message


def anthropic_exception_response(exc: BaseException) -> Response:
    status, message = _anthropic_describe(exc)
    response = anthropic_error_response(status, message)
    if isinstance(exc, ServerBusyError):
        response.headers["Retry-After"] = str(exc.retry_after)
    return response


def anthropic_sse_error(exc: BaseException) -> bytes:
    """The `error` event of a Messages stream that already started."""
    status, message = _anthropic_describe(exc)
    body = msgspec.json.encode(anthropic_error_body(status, message))
    return b"event: error\ndata: " + body + b"\n\n"
