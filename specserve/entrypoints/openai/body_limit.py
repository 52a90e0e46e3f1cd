"""Refuse request bodies over a size limit before reading them.

A body is parsed as JSON and its prompt tokenized only after it has arrived whole, so an oversized
one costs the server memory and CPU that every other request waits behind. A declared
Content-Length over the limit is answered 413 at once, unread; a chunked body is read here as it
arrives, refused as soon as it passes the limit, and otherwise handed on whole.
"""
from __future__ import annotations

from specserve.entrypoints.openai.errors import OpenAIError


class BodyLimitMiddleware:
    """A pure ASGI middleware: no task per request, unlike Starlette's BaseHTTPMiddleware."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        if declared is not None:
            return await self.app(scope, receive, send)
        # Chunked: read it all here, within the limit, and hand the app what was read.
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        await OpenAIError(413, f"the request body is larger than this server's limit of {self.max_bytes} bytes; "
                          "send a shorter prompt, or start the server with a larger --max-request-bytes",
                          code="request_too_large").send(send)
