"""--api-key: every request but GET /health must carry the key as `Authorization: Bearer KEY`.

/health stays open because supervisors and load balancers probe it without credentials, and it tells
nothing but whether the server can serve. The key is compared in constant time, so the time a refusal
takes does not tell how much of a guess was right.
"""
from __future__ import annotations

import hmac

from specserve.entrypoints.openai.errors import OpenAIError

_OPEN_PATHS = frozenset({"/health"})
_HOW = "send it as the header 'Authorization: Bearer KEY', with the key the server was started with"


class ApiKeyMiddleware:
    """A pure ASGI middleware: a request without the key is answered 401 before the app reads any of it."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:  # "lifespan": the app's start and stop
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        scheme, _, token = (given or b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key):
            return await self.app(scope, receive, send)
        message = f"this server needs an API key; {_HOW}" if given is None else f"the API key is not valid; {_HOW}"
        await OpenAIError(401, message, code="invalid_api_key").send(send, [(b"www-authenticate", b"Bearer")])
