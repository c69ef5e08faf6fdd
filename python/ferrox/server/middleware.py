"""Pure ASGI middleware: API-key check (constant time; a bearer token or
Anthropic's `x-api-key` header), request header and body size limits, all
answering with the OpenAI error envelope (Anthropic's on the Messages API's
routes). A body sent
in chunks is counted as it arrives: past the limit, reading it raises
`HTTPLimitError`, which the routes answer with 413."""

from __future__ import annotations

import hmac
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ferrox.server.error_responses import (
    HTTPLimitError,
    anthropic_error_response,
    error_response,
    is_anthropic_path,
)

OPEN_PATHS = frozenset({"/health", "/ping"})
MAX_HEADER_BYTES = 32 << 10


class GuardMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        max_body_bytes: int,
        max_header_bytes: int = MAX_HEADER_BYTES,
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw_headers = scope.get("headers") or []
        if sum(len(k) + len(v) for k, v in raw_headers) > self.max_header_bytes:
            await _error(
                scope,
                431,
                f"request headers exceed {self.max_header_bytes} bytes",
                "request_header_fields_too_large",
            )(scope, receive, send)
            return
        headers = dict(raw_headers)
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            other = headers.get(b"x-api-key", b"")
            if not (
                hmac.compare_digest(token, self.api_key) or hmac.compare_digest(other, self.api_key)
            ):
                await _error(scope, 401, "missing or invalid API key", "invalid_api_key")(
                    scope, receive, send
                )
                return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise self._too_large_error()
            return message

        await self.app(scope, limited_receive, send)

    def _too_large_error(self) -> HTTPLimitError:
        return HTTPLimitError(
            413, f"request body exceeds {self.max_body_bytes} bytes", code="request_too_large"
        )

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = self._too_large_error()
        await _error(scope, error.status, str(error), error.code)(scope, receive, send)


def _error(scope: Scope, status: int, message: str, code: str) -> Response:
    if is_anthropic_path(scope["path"]):
        return anthropic_error_response(status, message)
    return error_response(status, message, code=code)


def client_address(scope: dict[str, Any]) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"
