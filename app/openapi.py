"""The OpenAPI 3.1 document served at /openapi.json, generated from the msgspec models.

The request and response structs of app/protocol.py are what the server
decodes and encodes, so a schema made from them cannot drift from the
server; msgspec emits JSON Schema 2020-12, which OpenAPI 3.1 uses as is.
Clients generate code from it and fuzzers (schemathesis) drive the API
from it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from app.errors import ErrorResponse
from app.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)

REF_TEMPLATE = "#/components/schemas/{name}"

# (method, path, summary, request body, response body, streams)
_OPERATIONS: tuple[tuple[str, str, str, type | None, type, bool], ...] = (
    ("get", "/v1/models", "The served model", None, ModelList, False),
    ("post", "/v1/completions", "Complete prompts", CompletionRequest, CompletionResponse, True),
    ("post", "/v1/chat/completions", "Answer a conversation", ChatCompletionRequest, ChatCompletionResponse, True),
    ("post", "/tokenize", "Token ids of a prompt or conversation (vLLM)", TokenizeRequest, TokenizeResponse, False),
    ("post", "/detokenize", "Text of token ids (vLLM)", DetokenizeRequest, DetokenizeResponse, False),
)

# Every error the routes can answer with, all in OpenAI's shape.
_ERROR_STATUSES = {
    "400": "Invalid request",
    "401": "Missing or wrong API key",
    "404": "Unknown model",
    "413": "Request body too large",
    "503": "Engine asleep, server at capacity or shutting down",
}


def openapi_document(version: str) -> dict[str, Any]:
    types = [t for op in _OPERATIONS for t in op[3:5] if t is not None] + [ErrorResponse]
    (_, *_), components = msgspec.json.schema_components(types, ref_template=REF_TEMPLATE)
    error_ref = {"$ref": REF_TEMPLATE.format(name="ErrorResponse")}
    paths: dict[str, Any] = {}
    for method, path, summary, request_type, response_type, streams in _OPERATIONS:
        ok: dict[str, Any] = {"application/json": {"schema": {"$ref": REF_TEMPLATE.format(name=response_type.__name__)}}}
        if streams:
            ok["text/event-stream"] = {"schema": {"type": "string"}}
        operation: dict[str, Any] = {
            "summary": summary,
            "operationId": path.strip("/").replace("/", "_").replace(".", "_"),
            "responses": {
                "200": {"description": "OK", "content": ok},
                **{
                    status: {"description": text, "content": {"application/json": {"schema": error_ref}}}
                    for status, text in _ERROR_STATUSES.items()
                },
            },
        }
        if request_type is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": REF_TEMPLATE.format(name=request_type.__name__)}}},
            }
        paths[path] = {method: operation}
    return {
        "openapi": "3.1.0",
        "info": {"title": "ringllm", "version": version, "description": "OpenAI-compatible API of ringllm"},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{}, {"bearer": []}],
    }
