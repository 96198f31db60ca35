"""Request body size limit for the API (``--max-request-mb``): 413 at once, before a big body is read.

Plain ASGI: a declared ``Content-Length`` over the limit is answered before a byte of the body reaches the app; a body
without one (chunked) is counted while it arrives and answered as soon as it grows past the limit. What the client
still sends is discarded by the server as it arrives (never stored), and the connection stays usable. A client that
sends ``Expect: 100-continue`` (curl does for big bodies) gets the 413 without sending the body at all. Only the API's
paths are limited; the web UI's routes (Gradio uploads under ``/gradio_api``) keep Gradio's own limits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from extensions.openai import errors


class BodySizeLimit:
    """Answer 413 (an OpenAI error object; Ollama's shape under ``/api/``) to API requests larger than ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int, limited: Callable[[str], bool]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.limited = limited  # which paths are limited

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.limited(scope["path"]):
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None:
            if not length.strip().isdigit() or int(length) > self.max_bytes:
                await self.refuse(scope, receive, send, declared=length)
                return
            await self.app(scope, receive, send)  # the server never delivers more than Content-Length
            return
        # No Content-Length (chunked): take the body in, counting, before the route sees any of it.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self.refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the disconnect, as they would have

        await self.app(scope, replay, send)

    async def refuse(self, scope: Scope, receive: Receive, send: Send, declared: str | None = None) -> None:
        """The 413 (400 for a malformed Content-Length), sent at once; the rest of the body is never stored."""
        if declared is not None and not declared.strip().isdigit():
            status, message = 400, f"invalid Content-Length header {declared[:40]!r}"
        else:
            size = f" ({declared} bytes)" if declared else ""
            status, message = (
                413,
                (
                    f"the request body{size} is larger than this server accepts ({self.max_bytes / 2**20:g} MiB; "
                    "--max-request-mb raises the limit)"
                ),
            )
        path = scope["path"]
        body: dict[str, Any]
        if path.startswith("/api/"):  # Ollama's shape
            body = {"error": message}
        elif path.removeprefix("/v1").startswith("/messages"):  # Anthropic's shape
            kind = "request_too_large" if status == 413 else "invalid_request_error"
            body = {"type": "error", "error": {"type": kind, "message": message}}
        else:
            body = errors.APIError(status, message, code="request_too_large" if status == 413 else None).body()
        # No "Connection: close": closing with the body still arriving makes the kernel reset the connection, and a
        # client that reads only after sending (most) could lose the answer; the server discards the rest instead.
        await JSONResponse(body, status_code=status)(scope, receive, send)
