"""The aiohttp application: one middleware chain, one route table.

Middlewares, outermost first: CORS preflight (only when ``cors_origins`` is
set), the error path, API-key auth.  CORS headers on ordinary responses are
added in ``on_response_prepare`` so streams and errors carry them too.
"""

from __future__ import annotations

import hmac
import re

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler

from ds4d.config import Config
from ds4d.server import admin, openai_routes
from ds4d.server.errors import ApiError, error_middleware, error_response
from ds4d.server.state import API_KEY, LIFECYCLE, Lifecycle, ServingState

OPEN_PATHS = frozenset({"/health", "/openapi.json"})
MAX_HEADER_BYTES = 16384  # the request line, one header line or value; more gets 414/431 before any route
CORS_METHODS = "GET, POST, OPTIONS"
CORS_MAX_AGE_S = "600"


def _auth_middleware(keys: tuple[str, ...]):
    encoded = [k.encode() for k in keys]

    @web.middleware
    async def auth(request: web.Request, handler):
        if encoded and request.path not in OPEN_PATHS:
            header = request.headers.get("Authorization", "")
            token = header[7:].strip().encode() if header[:7].lower() == "bearer " else b""
            # compare against every key so timing does not reveal which one matched
            matched = False
            for key in encoded:
                matched |= hmac.compare_digest(token, key)
            if not matched:
                return error_response(ApiError(401, "missing or invalid API key (send Authorization: Bearer KEY)",
                                               type="authentication_error", code="invalid_api_key"))
            request[API_KEY] = token.decode()
        return await handler(request)

    return auth


class Cors:
    """CORS for the configured origins only; with none configured the app has no CORS at all."""

    def __init__(self, origins: tuple[str, ...]) -> None:
        self.any = "*" in origins
        self.origins = frozenset(origins)

    def allowed(self, origin: str | None) -> bool:
        return bool(origin) and (self.any or origin in self.origins)

    @web.middleware
    async def preflight(self, request: web.Request, handler):
        origin = request.headers.get("Origin")
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers \
                and self.allowed(origin):
            return web.Response(status=204, headers={
                "Access-Control-Allow-Methods": CORS_METHODS,
                "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers",
                                                                    "Authorization, Content-Type"),
                "Access-Control-Max-Age": CORS_MAX_AGE_S})
        return await handler(request)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if self.allowed(origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"


def _parser_error(status: int, exc: BaseException | None) -> ApiError:
    """The JSON error for a request aiohttp answered itself: one its HTTP parser refused, or one whose
    handler raised past the error middleware.  Bounded: at most the first line of the parser's reason."""
    if isinstance(exc, LineTooLong):
        line = bytes(exc.args[0]) if exc.args else b""
        # the C parser reports the request target it was reading, the pure-Python one the whole line
        if line.startswith(b"/") or re.match(rb"[A-Z]+ ", line):
            return ApiError(414, f"the request line is longer than {MAX_HEADER_BYTES} bytes",
                            code="request_uri_too_long")
        return ApiError(431, f"a request header line or value is longer than {MAX_HEADER_BYTES} bytes",
                        code="request_header_too_large")
    if isinstance(exc, HttpProcessingError):
        if exc.message == "Too many headers received":
            return ApiError(431, "too many request headers", code="request_header_too_large")
        first_line = exc.message.splitlines()[0] if exc.message else "unparsable request"
        return ApiError(400, f"malformed HTTP request: {first_line[:200]}", code="bad_request")
    if status == 504:
        return ApiError(504, "request handler timed out", type="server_error", code="timeout")
    if status >= 500:
        return ApiError(status, "internal server error", type="server_error", code="internal_error")
    return ApiError(status, "bad request", code="bad_request")


class JsonErrorRequestHandler(RequestHandler):
    """aiohttp answers a request its HTTP parser refuses (header or request line over the limits,
    bad request line, invalid header characters) in ``handle_error`` with plain text, before any
    route or middleware runs.  This keeps its logging and connection closing, and answers with the
    API's OpenAI-shaped JSON error instead."""

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises if a response was already sent
        resp = error_response(_parser_error(status, exc))
        resp.force_close()
        return resp


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class ApiRunner(web.AppRunner):
    """``web.AppRunner`` whose connections use :class:`JsonErrorRequestHandler`."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer  # the same server, only its protocol factory differs
        return server


def load_api_keys(api_keys: tuple[str, ...], api_key_file: str) -> tuple[str, ...]:
    """Keys from the config plus one per non-empty, non-comment line of the key file."""
    keys = [k for k in api_keys if k]
    if api_key_file:
        with open(api_key_file, encoding="utf-8") as fh:
            keys += [line.strip() for line in fh if line.strip() and not line.lstrip().startswith("#")]
    return tuple(keys)


def build_app(target: Lifecycle | ServingState) -> web.Application:
    """The app for a daemon that may still be loading (a Lifecycle) or is running (a ServingState)."""
    lifecycle = target if isinstance(target, Lifecycle) else Lifecycle(target.config, target)
    config: Config = lifecycle.config
    keys = load_api_keys(config.api_keys, config.api_key_file)
    middlewares = [error_middleware, _auth_middleware(keys)]
    cors = Cors(config.cors_origins) if config.cors_origins else None
    if cors is not None:
        middlewares.insert(0, cors.preflight)
    app = web.Application(
        middlewares=middlewares,
        client_max_size=config.max_body_bytes,
        handler_args={"max_field_size": MAX_HEADER_BYTES, "max_line_size": MAX_HEADER_BYTES},
    )
    if cors is not None:
        app.on_response_prepare.append(cors.on_prepare)
    app[LIFECYCLE] = lifecycle
    app.add_routes(openai_routes.routes)
    app.add_routes(admin.routes)
    return app
