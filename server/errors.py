"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

Every failure the HTTP front reports goes through `APIError`, so a client
sees one shape whatever went wrong: an invalid field (400, `param` names it),
an unknown model (404), a missing key (401), a full queue (429 with
Retry-After), a dead engine (503). FastAPI's own 422 validation bodies and
Starlette's plain-text 404/405 are rewritten into the same shape.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("serval.server")


class APIError(Exception):
    """A request that fails with an OpenAI-shaped error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = HTTPStatus.BAD_REQUEST,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.type = type or _default_type(self.status)
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _default_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def invalid_field(param: str, message: str) -> APIError:
    """400 naming the field: `invalid_field("top_p", "top_p must be in (0, 1], got 0")`."""
    return APIError(message, param=param, code="invalid_value")


def model_not_found(model: str, served: str) -> APIError:
    return APIError(
        f"The model `{model}` does not exist. This server serves `{served}`.",
        status=HTTPStatus.NOT_FOUND,
        param="model",
        code="model_not_found",
    )


def engine_dead() -> APIError:
    return APIError(
        "The inference engine is not running (its process exited); the server cannot answer requests.",
        status=HTTPStatus.SERVICE_UNAVAILABLE,
        code="engine_dead",
    )


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "bytes", "any"}


def _loc_to_param(loc: tuple[Any, ...], keep_last: bool = False) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'.

    pydantic puts union members in the location (('body', 'stop', 'list[str]', 0));
    those tags are dropped: request fields are lower-case identifiers, the tags are
    type names ('str', 'list[int]', 'TextPart'). keep_last keeps the final segment
    as is (an unknown field's own name)."""
    parts = [p for p in loc if p not in ("body", "query", "path", "header")]
    out = ""
    for i, p in enumerate(parts):
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and (
            (keep_last and i == len(parts) - 1)
            or (p.isidentifier() and p.lower() == p and p not in _TYPE_TAGS)
        ):
            out += f".{p}" if out else p
    return out or None


def validation_error_to_api_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError("Invalid request body.")
    first = errors[0]
    kind = first.get("type", "")
    loc = tuple(first.get("loc", ()))
    param = _loc_to_param(loc)
    if kind == "json_invalid":
        return APIError(f"The request body is not valid JSON: {first.get('msg', '')}", code="invalid_json")
    if kind == "extra_forbidden":
        param = _loc_to_param(loc, keep_last=True)
        return APIError(
            f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter"
        )
    if kind == "missing" and loc == ("body",):
        return APIError("The request body is missing; send a JSON object.", code="invalid_json")
    if kind == "model_attributes_type" and loc == ("body",):
        return APIError("The request body must be a JSON object (sent with Content-Type: application/json).",
                        code="invalid_json")
    msg = first.get("msg", "invalid value")
    if len(errors) > 1 and param is not None:
        # Union types report one error per member; say what was received once.
        same_field = [e for e in errors if _loc_to_param(tuple(e.get("loc", ()))) == param]
        if len(same_field) == len(errors) and "input" in first:
            return APIError(
                f"{param}: invalid value {json.dumps(first['input'])[:200]} ({first.get('msg', 'wrong type')})",
                param=param, code="invalid_type",
            )
    return APIError(f"{param or 'body'}: {msg}", param=param, code="invalid_type")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_to_api_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = APIError(str(exc.detail), status=exc.status_code, code=code,
                       headers=getattr(exc, "headers", None))
        return err.response()

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return APIError(f"Internal server error: {type(exc).__name__}: {exc}", status=500).response()


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` entries for the error statuses a route can return."""
    from server.protocol import ErrorResponse

    text = {
        400: "Invalid request: a field is missing, malformed or out of range (`param` names it)",
        401: "Missing or wrong API key",
        404: "Unknown model",
        429: "Too many queued requests; retry after the number of seconds in Retry-After",
        503: "The inference engine is not running",
    }
    return {s: {"model": ErrorResponse, "description": text.get(s, HTTPStatus(s).phrase)} for s in statuses}
