"""OpenAI error objects, and the mapping from textgen's typed exceptions to HTTP statuses."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from modules.errors import (
    BackendUnavailable,
    ContextOverflow,
    EngineUnavailable,
    ExtensionFailed,
    InvalidRequest,
    ModelLoadError,
    ModelNotFound,
    ModelNotLoaded,
    NotSupported,
    QueueFull,
    TextgenError,
)

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered with an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients expect."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """As an HTTP response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_exception(exc: BaseException) -> APIError:
    """Map any exception to an APIError; unexpected ones become a 500 that says what failed."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextOverflow):
        return APIError(400, str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, InvalidRequest):
        return APIError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, NotSupported):
        return APIError(400, str(exc), code="not_supported")
    if isinstance(exc, ModelNotFound):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, ModelNotLoaded):
        return APIError(503, str(exc), type_="service_unavailable", code="model_not_loaded")
    if isinstance(exc, EngineUnavailable):
        return APIError(503, str(exc), type_="service_unavailable", code="engine_unavailable")
    if isinstance(exc, QueueFull):
        return APIError(
            503,
            str(exc),
            type_="service_unavailable",
            code="server_busy",
            headers={"Retry-After": str(exc.retry_after)},
        )
    if isinstance(exc, (ModelLoadError, BackendUnavailable)):
        return APIError(400, str(exc), code="model_load_failed")
    if isinstance(exc, ExtensionFailed):  # the server's failure, not the client's
        return APIError(500, str(exc), type_="server_error", code="extension_failed")
    if isinstance(exc, TextgenError):
        return APIError(400, str(exc))
    log.error("unexpected API error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error")


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The message and the field (param) of a request that does not validate."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    message = str(first.get("msg", "invalid value"))
    return (f"{param}: {message}" if param else message), param


def install(app: FastAPI) -> None:
    """Register handlers so that every API error is an OpenAI error object (400, never 422)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(TextgenError)
    async def _textgen_error(request: Request, exc: TextgenError) -> JSONResponse:
        return from_exception(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type_=kind).response()
