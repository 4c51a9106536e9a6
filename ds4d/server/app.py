"""The aiohttp application: one middleware chain, one route table.

Middlewares, outermost first: CORS preflight (only when ``cors_origins`` is
set), the error path, API-key auth.  CORS headers on ordinary responses are
added in ``on_response_prepare`` so streams and errors carry them too.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from ds4d.config import Config
from ds4d.server import admin, openai_routes
from ds4d.server.errors import ApiError, error_middleware, error_response
from ds4d.server.state import API_KEY, LIFECYCLE, Lifecycle, ServingState

OPEN_PATHS = frozenset({"/health", "/openapi.json"})
MAX_HEADER_BYTES = 16384  # one header line or value; more gets aiohttp's 400 before any route
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
