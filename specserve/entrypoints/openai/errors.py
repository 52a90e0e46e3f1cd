"""Every failure leaves the server as an OpenAI error body {"error": {message, type, param, code}}.

Exception handlers cover what FastAPI raises itself (bad JSON, schema
violations, unknown routes) and anything unexpected, so no input can reach a
client as a bare traceback or take the server down.
"""
from __future__ import annotations

import difflib
import json
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from specserve.entrypoints.openai.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest,
                                                   ContentPart, NOT_SUPPORTED, NOT_SUPPORTED_BECAUSE, StreamOptions)
from specserve.entrypoints.openai.responses import ErrorInfo, ErrorResponse
from specserve.entrypoints.openai.tokenize_fields import DetokenizeRequest, TokenizeRequest
from specserve.entrypoints.openai.tool_fields import (CalledFunction, ChosenFunction, FunctionDefinition, FunctionTool,
                                                      MessageToolCall, NamedToolChoice)
from specserve.errors import EngineUnavailableError, InvalidRequestError, QueueFullError, RequestTimeoutError

logger = logging.getLogger(__name__)

# Names a validation error's location may hold; pydantic also puts the tried member types of a
# union there ("str", "list[int]"), which are not part of the parameter's name.
_FIELD_NAMES = set().union(*(m.model_fields for m in (CompletionRequest, ChatCompletionRequest, ChatMessage,
                                                      ContentPart, StreamOptions, FunctionTool, FunctionDefinition,
                                                      NamedToolChoice, ChosenFunction, MessageToolCall,
                                                      CalledFunction, TokenizeRequest, DetokenizeRequest)))
_ENDPOINT_FIELDS = {"/v1/completions": set(CompletionRequest.model_fields),
                    "/v1/chat/completions": set(ChatCompletionRequest.model_fields),
                    "/tokenize": set(TokenizeRequest.model_fields), "/detokenize": set(DetokenizeRequest.model_fields)}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def body(self) -> dict:
        return ErrorResponse(error=self.info).model_dump()

    def encoded(self) -> bytes:
        """The body as JSON in ASCII: a message may quote a request's text, which may not be valid Unicode."""
        return json.dumps(self.body()).encode()

    def response(self, headers: dict[str, str] | None = None) -> Response:
        return Response(self.encoded(), status_code=self.status, headers=headers, media_type="application/json")

    async def send(self, send, headers: list[tuple[bytes, bytes]] = ()) -> None:
        """Answer with this error through an ASGI `send`, and close the connection (for middleware that
        answers before the app has read the request)."""
        body = self.encoded()
        await send({"type": "http.response.start", "status": self.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close"), *headers]})
        await send({"type": "http.response.body", "body": body})


def to_openai_error(e: Exception, param_name=lambda field: field) -> OpenAIError:
    """Map an engine-side exception to its HTTP error; param_name renames engine fields to the
    endpoint's parameter names (e.g. prompt -> messages for chat)."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, InvalidRequestError):
        param = param_name(e.field)
        return OpenAIError(400, f"{param}: {str(e).removeprefix(e.field + ': ')}", param=param)
    if isinstance(e, QueueFullError):
        return OpenAIError(503, str(e), "service_unavailable_error", code="queue_full")
    if isinstance(e, RequestTimeoutError):
        return OpenAIError(408, str(e), "timeout_error", code="request_timeout")
    if isinstance(e, EngineUnavailableError):
        return OpenAIError(503, str(e), "service_unavailable_error", code="engine_unavailable")
    logger.error("unexpected error serving a request", exc_info=e)
    return OpenAIError(500, f"internal error: {type(e).__name__}", "internal_error")


def _validation_error(exc: RequestValidationError, path: str) -> OpenAIError:
    errors = exc.errors()
    if errors[0].get("type") == "json_invalid":
        detail = errors[0].get("ctx", {}).get("error", "cannot be parsed")
        return OpenAIError(400, f"the request body is not valid JSON: {detail}", code="invalid_json")
    # A value that fails every member of a union fails each in its own error; the member that got furthest
    # into the value (the deepest location) says best what is wrong with it.
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    loc = list(first.get("loc", ()))[1:]  # the first is "body"
    unknown = loc.pop() if first["type"] == "extra_forbidden" and loc else None
    # Locations also hold the tried members of a union ("str", "list[int]") and dict keys, which are not part
    # of the parameter's name: ["messages", 0, "content", "list[ContentPart]", 0] -> "messages[0].content[0]".
    parts = [p for p in loc if isinstance(p, int) or p in _FIELD_NAMES] + ([unknown] if unknown is not None else [])
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".") or None
    if unknown is not None:
        # A misspelt top-level field is matched against the endpoint's own fields, a nested one against all.
        known = _ENDPOINT_FIELDS.get(path, _FIELD_NAMES) if len(parts) == 1 else _FIELD_NAMES
        return OpenAIError(400, f"{param}: {_unknown_field(str(unknown), known)}", param=param)
    message = f"{param}: {first['msg']}" if param else f"the request body is invalid: {first['msg']}"
    return OpenAIError(400, message, param=param)


def _unknown_field(name: str, known) -> str:
    if name in NOT_SUPPORTED_BECAUSE:
        return NOT_SUPPORTED_BECAUSE[name]
    if name in NOT_SUPPORTED:
        return "is not supported by this server yet; remove it from the request"
    close = difflib.get_close_matches(name, sorted(known), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"is not a parameter this server knows; {hint}check its spelling, or remove it"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return _validation_error(exc, request.url.path).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            message = f"there is no route {request.method} {request.url.path}"
        else:
            message = str(exc.detail) or HTTPStatus(exc.status_code).phrase
        error = OpenAIError(exc.status_code, message, code=HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_"))
        return error.response(exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        return to_openai_error(exc).response()
