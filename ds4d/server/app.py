"""The aiohttp application: one middleware chain, one route table."""

from __future__ import annotations

import hmac

from aiohttp import web

from ds4d.server import admin, openai_routes
from ds4d.server.errors import ApiError, error_middleware, error_response
from ds4d.server.state import STATE, ServingState

OPEN_PATHS = frozenset({"/health"})


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
            request["api_key"] = token.decode()
        return await handler(request)

    return auth


def load_api_keys(api_keys: tuple[str, ...], api_key_file: str) -> tuple[str, ...]:
    """Keys from the config plus one per non-empty, non-comment line of the key file."""
    keys = [k for k in api_keys if k]
    if api_key_file:
        with open(api_key_file, encoding="utf-8") as fh:
            keys += [line.strip() for line in fh if line.strip() and not line.lstrip().startswith("#")]
    return tuple(keys)


def build_app(state: ServingState) -> web.Application:
    keys = load_api_keys(state.config.api_keys, state.config.api_key_file)
    app = web.Application(
        middlewares=[error_middleware, _auth_middleware(keys)],
        client_max_size=state.config.max_body_bytes,
        handler_args={"max_field_size": 16384, "max_line_size": 16384},
    )
    app[STATE] = state
    app.add_routes(openai_routes.routes)
    app.add_routes(admin.routes)
    return app
