"""Errors as the API reports them: OpenAI's `{"error": {message, type, param, code}}` on every
route but Ollama's (`/api/...`), which answer `{"error": "message"}`; always the status the
error class names, never a traceback."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from localchat.errors import InvalidRequestError, LocalchatError

log = logging.getLogger("localchat.server")

_STATUS_TYPES = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", "forbidden"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_content_type"),
    503: ("server_error", "server_busy"),
}


class APIError(LocalchatError):
    """An error of the HTTP layer itself (auth, body size, routing), with its own status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, error_type: str | None = None) -> None:
        super().__init__(message)
        default_type, default_code = _STATUS_TYPES.get(status, ("server_error", None))
        self.http_status = status
        self.error_type = error_type or default_type
        self.code = code or default_code
        self.param = param


def is_ollama(path: str) -> bool:
    """Whether a path belongs to the Ollama API (whose errors are plain strings)."""
    return path.startswith("/api/")


def error_body(error: LocalchatError, path: str) -> dict[str, Any]:
    """The JSON body for `error` on `path`: Ollama's, Anthropic's (`/v1/messages`) or
    OpenAI's shape."""
    if is_ollama(path):
        return {"error": str(error)}
    if path.startswith("/v1/messages"):
        from localchat.server.messages_events import ERROR_TYPES

        status = int(getattr(error, "http_status", 500) or 500)
        return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                           "message": str(error)}}
    return {"error": error.to_dict()}


def error_response(error: LocalchatError, path: str) -> JSONResponse:
    """The response for an error on `path`."""
    status = int(getattr(error, "http_status", 500) or 500)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_body(error, path), status_code=status, headers=headers)


def param_of(loc: tuple[Any, ...]) -> str | None:
    """`messages[0].role` for a pydantic error location; union tags are left out."""
    out = ""
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
        else:
            break
    return out or None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after",
              "function-before", "function-wrap", "literal", "tagged-union"}


def validation_error(exc: ValidationError | RequestValidationError) -> InvalidRequestError:
    """The first problem of a pydantic validation as an InvalidRequestError naming its field."""
    errors = exc.errors()
    if not errors:
        return InvalidRequestError("invalid request body")
    first = errors[0]
    param = param_of(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        return InvalidRequestError(f"the request body is not valid JSON: {first.get('msg')}")
    if first.get("type") == "missing":
        return InvalidRequestError(f"missing required parameter: {param!r}", param)
    if first.get("type") == "model_type" and param is None:
        return InvalidRequestError("the request body must be a JSON object")
    prefix = f"invalid value for {param!r}: " if param else ""
    return InvalidRequestError(f"{prefix}{first.get('msg')}", param)


def install(app: FastAPI) -> None:
    """Register the handlers that turn every failure into an API error response."""

    @app.exception_handler(LocalchatError)
    async def _localchat(request: Request, exc: LocalchatError) -> JSONResponse:
        if exc.http_status >= 500:
            log.error("%s %s failed: %s", request.method, request.url.path, exc)
        return error_response(exc, request.url.path)

    @app.exception_handler(ValidationError)
    async def _pydantic(request: Request, exc: ValidationError) -> JSONResponse:
        return error_response(validation_error(exc), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _fastapi(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail) if exc.detail else "error"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(APIError(exc.status_code, message), request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s: unexpected error", request.method, request.url.path)
        error = APIError(500, f"internal server error ({type(exc).__name__})",
                         code="internal_error")
        return error_response(error, request.url.path)
