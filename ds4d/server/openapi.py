"""The daemon's own OpenAPI 3.1 document, served at ``GET /openapi.json``.

Request bodies come from the pydantic models the handlers validate with, and
responses from the models in ``schemas.py`` that describe what the handlers
write, so the document cannot drift from the code without the fuzz tests
(``tests/http/test_openapi_fuzz.py``) noticing: they send generated requests
and check every response against this document.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from ds4d import __version__
from ds4d.server import schemas

ERROR_STATUSES = {
    "400": "Invalid request: bad JSON, a field of the wrong type or value (``param`` names it), a prompt over "
           "the context limit (code ``context_length_exceeded``)",
    "401": "Missing or wrong API key",
    "404": "Unknown model or route",
    "413": "Request body over the size limit",
    "500": "Internal error (never a traceback)",
    "503": "Loading, draining, dead engine or over an admission cap (with Retry-After)",
    "504": "Queue wait or request time limit reached",
}

REQUESTS: dict[str, type[BaseModel]] = {
    "ChatCompletionRequest": schemas.ChatCompletionRequest,
    "CompletionRequest": schemas.CompletionRequest,
    "TokenizeRequest": schemas.TokenizeRequest,
    "DetokenizeRequest": schemas.DetokenizeRequest,
}
RESPONSES: dict[str, type[BaseModel]] = {
    "ErrorResponse": schemas.ErrorResponse,
    "ChatCompletion": schemas.ChatCompletion,
    "Completion": schemas.Completion,
    "ModelList": schemas.ModelList,
    "TokenizeResponse": schemas.TokenizeResponse,
    "DetokenizeResponse": schemas.DetokenizeResponse,
    "HealthResponse": schemas.HealthResponse,
    "ReadyResponse": schemas.ReadyResponse,
}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str) -> dict:
    return {"application/json": {"schema": _ref(name)}}


def _errors(*statuses: str) -> dict:
    return {s: {"description": ERROR_STATUSES[s], "content": _json("ErrorResponse")} for s in statuses}


SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}},
    "description": "One server-sent event: a JSON chunk (or an OpenAI error object) per `data:` line; "
                   "`: keepalive` comments between; the last event is `data: [DONE]`"}}}
API_ERRORS = ("400", "401", "404", "413", "500", "503")


def _post(summary: str, request: str, response: str, *, stream: bool) -> dict:
    content = {**_json(response), **(SSE if stream else {})}
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": _json(request)},
        "responses": {"200": {"description": "OK (a stream when `stream` is true)" if stream else "OK",
                              "content": content},
                      **_errors(*API_ERRORS, *(("504",) if stream else ()))},
    }}


def _get(summary: str, content: dict, *errors: str, open_route: bool = False, also: dict | None = None) -> dict:
    op: dict[str, Any] = {"summary": summary,
                          "responses": {"200": {"description": "OK", "content": content}, **(also or {}),
                                        **_errors(*errors)}}
    if open_route:
        op["security"] = []
    return {"get": op}


@cache
def openapi_document() -> dict:
    _, top = models_json_schema(
        [(m, "validation") for m in REQUESTS.values()] + [(m, "serialization") for m in RESPONSES.values()],
        ref_template="#/components/schemas/{model}")
    components = top.get("$defs", {})
    paths = {
        "/v1/chat/completions": _post("Chat completion (OpenAI)", "ChatCompletionRequest", "ChatCompletion",
                                      stream=True),
        "/v1/completions": _post("Text completion (OpenAI)", "CompletionRequest", "Completion", stream=True),
        "/tokenize": _post("Token ids of a prompt or of rendered chat messages", "TokenizeRequest",
                           "TokenizeResponse", stream=False),
        "/detokenize": _post("Text of token ids", "DetokenizeRequest", "DetokenizeResponse", stream=False),
        "/v1/models": _get("The served model", _json("ModelList"), "401", "503"),
        "/health": _get("Liveness", _json("HealthResponse"), open_route=True,
                        also={"503": {"description": "The engine is dead", "content": _json("HealthResponse")}}),
        "/ready": _get("Readiness", _json("ReadyResponse"), "401",
                       also={"503": {"description": "Not ready (reasons given)", "content": _json("ReadyResponse")}}),
        "/metrics": _get("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}, "401", "503"),
        "/v1/ds4d/stats": _get("Engine, cache, memory and session statistics",
                               {"application/json": {"schema": {"type": "object"}}}, "401", "503"),
        "/openapi.json": _get("This document", {"application/json": {"schema": {"type": "object"}}},
                              open_route=True),
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "ds4d", "version": __version__,
                 "description": "OpenAI-compatible API of the ds4d daemon, with its own extensions."},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }
