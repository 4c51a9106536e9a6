"""The one error path: every non-2xx answer is an OpenAI-shaped JSON error.

Handlers raise :class:`ApiError`; the middleware turns it (and aiohttp's own
HTTP errors, pydantic validation errors and anything unexpected) into
``{"error": {"message", "type", "param", "code"}}`` with a bounded message —
never a traceback or a file path.
"""

from __future__ import annotations

import json
import logging

from aiohttp import web
from pydantic import ValidationError

log = logging.getLogger("ds4d.server")

MAX_MESSAGE_CHARS = 500


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code or {400: "invalid_request", 401: "invalid_api_key", 404: "not_found",
                             413: "request_too_large", 503: "unavailable"}.get(status, "error")
        self.headers = headers or {}


def error_body(status: int, message: str, type: str, param: str | None, code: str) -> dict:
    return {"error": {"message": message[:MAX_MESSAGE_CHARS], "type": type, "param": param, "code": code}}


def error_response(err: ApiError) -> web.Response:
    body = error_body(err.status, err.message, err.type, err.param, err.code)
    return web.json_response(body, status=err.status, headers=err.headers)


def from_validation(exc: ValidationError) -> ApiError:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    msg = first.get("msg", "invalid value")
    return ApiError(400, f"invalid value for {param or 'body'}: {msg}", param=param, code="invalid_value")


async def parse_json(request: web.Request) -> dict:
    raw = await request.read()  # raises 413 past client_max_size
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON ({exc.msg if hasattr(exc, 'msg') else 'bad encoding'})",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return body


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err)
    except ValidationError as exc:
        return error_response(from_validation(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}.get(
            exc.status, "invalid_request_error")
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status, "http_error")
        message = {404: f"no route {request.method} {request.path}", 413: "request body too large"}.get(
            exc.status, exc.reason)
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return web.json_response(error_body(exc.status, message, kind, None, code), status=exc.status,
                                 headers=headers)
    except ConnectionResetError:
        raise
    except Exception:  # noqa: BLE001 - the one place unexpected errors become a 500
        log.exception("unhandled error in %s %s", request.method, request.path)
        return web.json_response(error_body(500, "internal server error", "server_error", None, "internal_error"),
                                 status=500)

