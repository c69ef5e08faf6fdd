"""Pure ASGI middleware: API-key check (constant time) and request body size
limit, both answering with the OpenAI error envelope."""

from __future__ import annotations

import hmac
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ferrox.server.errors import error_response

OPEN_PATHS = frozenset({"/health"})


class BodyTooLarge(Exception):
    pass


class GuardMiddleware:
    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.api_key):
                await error_response(401, "missing or invalid API key", code="invalid_api_key")(
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
                    raise BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except BodyTooLarge:
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413, f"request body exceeds {self.max_body_bytes} bytes", code="request_too_large"
        )
        await response(scope, receive, send)


def client_address(scope: dict[str, Any]) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"
