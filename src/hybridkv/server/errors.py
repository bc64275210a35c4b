"""Errors in OpenAI's envelope, `{"error": {"message", "type", "param", "code"}}`, for every
failure the server answers: bad JSON, schema errors, bad values, auth, unknown routes, a
full queue, and (logged, without a traceback to the client) bugs."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from hybridkv.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 409: "ConflictError", 413: "BadRequestError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


# Fields of several types, and what they accept.
UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "messages": "a list of messages {role, content}, content a string or a list of "
                "{type: text, text} parts",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = dict(headers or {})


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    info = ErrorInfo(message=message, type=ERROR_TYPES.get(status, "Error"), param=param,
                     code=status)
    return ErrorResponse(error=info).model_dump()


def error_response(status: int, message: str, param: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status,
                        headers=dict(headers or {}))


def describe_validation_error(errors: Sequence[Any]) -> tuple[str, str | None]:
    """(message, param) for pydantic's errors: the first one, with its field path."""
    if not errors:
        return "the request body is invalid", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return f"malformed JSON in the request body: {detail}".rstrip(": "), None
    if not loc:
        return ("the request body must be a JSON object (sent with Content-Type: "
                "application/json)"), None
    param = loc[0]
    path = ".".join(loc)
    if kind == "extra_forbidden":
        return f"unknown field '{path}'", param
    if kind == "missing":
        return f"field '{path}' is required", param
    if param in UNION_FIELDS and len(errors) > 1:
        # A union reports one error per member it tried; say what the field accepts.
        return f"'{param}' must be {UNION_FIELDS[param]}", param
    return f"'{path}': {first.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(exc.errors())
        return error_response(400, message, param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = str(exc.detail) if exc.detail else "error"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(exc.status_code, message, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request")
        return error_response(500, f"internal server error ({type(exc).__name__})")
