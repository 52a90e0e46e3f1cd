"""Every failure leaves the server as an OpenAI error body {"error": {message, type, param, code}}.

Exception handlers cover what FastAPI raises itself (bad JSON, schema
violations, unknown routes) and anything unexpected, so no input can reach a
client as a bare traceback or take the server down.
"""
from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from specserve.entrypoints.openai.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest,
                                                   ContentPart, ErrorInfo, ErrorResponse, StreamOptions)
from specserve.errors import EngineUnavailableError, InvalidRequestError, QueueFullError, RequestTimeoutError

logger = logging.getLogger(__name__)

# Names a validation error's location may hold; pydantic also puts the tried member types of a
# union there ("str", "list[int]"), which are not part of the parameter's name.
_FIELD_NAMES = set().union(*(m.model_fields for m in (CompletionRequest, ChatCompletionRequest, ChatMessage,
                                                      ContentPart, StreamOptions)))


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def body(self) -> dict:
        return ErrorResponse(error=self.info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


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


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "cannot be parsed")
        return OpenAIError(400, f"the request body is not valid JSON: {detail}", code="invalid_json")
    loc = []
    for part in first.get("loc", ())[1:]:  # the first is "body"
        if not isinstance(part, int) and part not in _FIELD_NAMES:
            break
        loc.append(part)
    # ["messages", 0, "content"] -> "messages[0].content"
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    message = f"{param}: {first['msg']}" if param else f"the request body is invalid: {first['msg']}"
    return OpenAIError(400, message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"there is no route {request.method} {request.url.path}"
        else:
            message = str(exc.detail) or HTTPStatus(exc.status_code).phrase
        error = OpenAIError(exc.status_code, message, code=HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_"))
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return to_openai_error(exc).response()
