"""Every error as the OpenAI envelope {"error": {"message", "type", "code"}}: the app's own (HTTPException), the
router's (404, 405, a body that does not parse), validation (422; malformed JSON 400), crashes (500), and errors
reported in-band in a stream whose status line is already sent.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException  # FastAPI's HTTPException subclasses it

from engine.errors import EngineError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "code": status}}


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=dict(headers or {}))


def validation_message(exc: RequestValidationError) -> tuple[int, str]:
    errs = exc.errors()
    bad_json = [e for e in errs if e["type"] == "json_invalid"]
    if bad_json:
        return 400, f"malformed JSON: {bad_json[0].get('ctx', {}).get('error', bad_json[0]['msg'])}"
    parts = []
    for e in errs[:5]:
        where = ".".join(str(x) for x in e["loc"][1:]) or "body"
        parts.append(f"{where}: {e['msg']}")
    return 422, "; ".join(parts)


def stream_error(exc: BaseException) -> str:
    """The SSE event for an error after the stream began: bad input (EngineError) 400, anything else 500."""
    status, message = (400, str(exc)) if isinstance(exc, EngineError) else (500, f"internal error: {exc}")
    return f"data: {json.dumps(error_body(status, message))}\n\n"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), exc.headers)  # keeps 405's Allow header

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(*validation_message(exc))

    @app.exception_handler(Exception)
    async def crashed(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
