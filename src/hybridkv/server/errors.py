"""Errors in OpenAI's envelope, `{"error": {"message", "type", "param", "code"}}`, for every
failure the server answers: bad JSON, schema errors, bad values, auth, unknown routes, a
full queue, and (logged, without a traceback to the client) bugs. An API with an envelope of
its own (Anthropic's, Ollama's) registers it for its paths (`register_envelope`): the same
failures then answer in its shape."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from hybridkv.server.protocol import PROMPT_FORMS, ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 409: "ConflictError", 413: "BadRequestError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


# Fields of several types, and what they accept.
UNION_FIELDS = {
    "prompt": PROMPT_FORMS,
    "stop": "a string or a list of strings",
    "messages": "a list of messages {role, content}, content a string or a list of "
                "{type: text, text} parts",
    "tool_choice": 'none, auto, required or {"type": "function", "function": {"name": ...}}',
}
# pydantic's words for a wrong type, as the JSON a client sends names it.
_TYPE_WORDS = {"string_type": "a string", "int_type": "an integer", "int_from_float":
               "an integer", "float_type": "a number", "bool_type": "true or false",
               "list_type": "a list", "dict_type": "an object", "model_type": "an object",
               "model_attributes_type": "an object"}


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


# (status, message, param) -> an error's JSON body
ErrorBody = Callable[[int, str, "str | None"], dict[str, Any]]
# Path prefix -> the envelope of the API served there; OpenAI's everywhere else.
_ENVELOPES: dict[str, ErrorBody] = {}


def register_envelope(prefix: str, body: ErrorBody) -> None:
    _ENVELOPES[prefix] = body


def envelope_for(path: str | None) -> ErrorBody:
    if path:
        for prefix, body in _ENVELOPES.items():
            if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
                return body
    return error_body


def error_response(status: int, message: str, param: str | None = None,
                   headers: Mapping[str, str] | None = None, *,
                   path: str | None = None) -> JSONResponse:
    """The error in the envelope of the API that `path` belongs to."""
    return JSONResponse(envelope_for(path)(status, message, param), status_code=status,
                        headers=dict(headers or {}))


def field_path(loc: Sequence[Any], body: Any, missing: bool = False) -> list[str | int]:
    """The path of a pydantic error in the client's JSON: `loc` also names the member of a
    union it was tried against ('list[TextPart]', a tag), which the body has no key for."""
    path: list[str | int] = []
    value = body
    parts = list(loc[1:]) if loc and loc[0] == "body" else list(loc)  # FastAPI's prefix
    for i, part in enumerate(parts):
        in_dict = isinstance(value, dict) and part in value
        in_list = isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value)
        if in_dict or in_list:
            value = value[part]
        elif not (missing and i == len(parts) - 1):  # (the field that is missing stays)
            continue
        path.append(part)
    return path


def dotted(path: Sequence[str | int]) -> str:
    """messages[0].content[1].text, as the client would index it."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text


def describe_validation_error(errors: Sequence[Any], body: Any = None
                              ) -> tuple[str, str | None]:
    """(message, param) for pydantic's errors. Of a union's errors (one per member it
    tried), the one that got furthest into the client's JSON; when members tie, what the
    field accepts."""
    if not errors:
        return "the request body is invalid", None
    if errors[0].get("type") == "json_invalid":
        detail = errors[0].get("ctx", {}).get("error", "")
        return f"malformed JSON in the request body: {detail}".rstrip(": "), None
    paths = [field_path(e.get("loc", ()), body, e.get("type") == "missing") for e in errors]
    # An unknown field, or another kind of content part, says most: the member was right.
    chosen = next((i for i, e in enumerate(errors)
                   if e.get("type") in ("unknown_field", "part_type")), None)
    if chosen is None:
        deepest = max(len(path) for path in paths)
        at_deepest = [i for i, path in enumerate(paths) if len(path) == deepest]
        param = str(paths[at_deepest[0]][0]) if paths[at_deepest[0]] else None
        if len(at_deepest) > 1 and param in UNION_FIELDS:
            return f"'{param}' must be {UNION_FIELDS[param]}", param
        chosen = at_deepest[0]
    error, path = errors[chosen], paths[chosen]
    param = str(path[0]) if path else None
    kind, ctx = error.get("type", ""), error.get("ctx") or {}
    where = dotted(path)
    if not path and (kind in _TYPE_WORDS or kind == "missing"):
        return ("the request body must be a JSON object (sent with Content-Type: "
                "application/json)"), None
    if kind == "unknown_field":
        where = dotted([*path, ctx.get("field", "")])
        return f"unknown field '{where}'; accepted: {ctx.get('accepted', '')}", \
            param or str(ctx.get("field"))
    if kind == "prompt_form" and param in UNION_FIELDS:
        return f"'{param}' must be {UNION_FIELDS[param]}", param
    if kind == "missing":
        return f"field '{where}' is required", param
    if kind in _TYPE_WORDS:
        return f"'{where}' must be {_TYPE_WORDS[kind]}", param
    if kind == "too_long" and isinstance(ctx.get("max_length"), int):
        return f"'{where}' has more than {ctx['max_length']:,} items, the most accepted", param
    if kind == "too_short" and isinstance(ctx.get("min_length"), int):
        return f"'{where}' needs at least {ctx['min_length']:,} item(s)", param
    if kind == "bias_type":  # names its entry itself
        return str(error.get("msg")), param
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"'{where}': {message}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.headers,
                              path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(exc.errors(), getattr(exc, "body", None))
        return error_response(400, message, param, path=request.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = str(exc.detail) if exc.detail else "error"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(exc.status_code, message, headers=exc.headers,
                              path=request.url.path)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request")
        return error_response(500, f"internal server error ({type(exc).__name__})",
                              path=request.url.path)
