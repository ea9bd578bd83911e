"""The OpenAPI 3.1 document served at /openapi.json, generated from the msgspec models.

The request and response structs of app/protocol/ are what the server
decodes and encodes, so a schema made from them cannot drift from the
server; msgspec emits JSON Schema 2020-12, which OpenAPI 3.1 uses as is.
Clients generate code from it and fuzzers (schemathesis) drive the API
from it. The structs carry no ranges, so the ranges the server checks
(core/protocol.py, app/protocol/) are written onto the generated request
schemas here, with the served model names; fields the server declares only to
refuse are left out.
"""

from __future__ import annotations

from typing import Any

import msgspec

from app.errors import ErrorResponse
from app.protocol.chat import ChatCompletionRequest, ChatCompletionResponse
from app.protocol.common import ModelList
from app.protocol.completions import CompletionRequest, CompletionResponse
from app.protocol.messages import ErrorResponse as AnthropicErrorResponse
from app.protocol.messages import Message, MessagesRequest
from app.protocol.pooling import (
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingRequest,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from app.protocol.responses import ResponsesRequest
from app.protocol.sampling import MAX_N
from app.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from core.protocol import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_TOP_K

REF_TEMPLATE = "#/components/schemas/{name}"

# (method, path, summary, request body, response body, streams)
_OPERATIONS: tuple[tuple[str, str, str, type | None, type, bool], ...] = (
    ("get", "/v1/models", "The served model", None, ModelList, False),
    ("post", "/v1/completions", "Complete prompts", CompletionRequest, CompletionResponse, True),
    ("post", "/v1/chat/completions", "Answer a conversation", ChatCompletionRequest, ChatCompletionResponse, True),
    ("post", "/tokenize", "Token ids of a prompt or conversation (vLLM)", TokenizeRequest, TokenizeResponse, False),
    ("post", "/detokenize", "Text of token ids (vLLM)", DetokenizeRequest, DetokenizeResponse, False),
    ("post", "/v1/embeddings", "Embed inputs (pooling models)", EmbeddingRequest, EmbeddingResponse, False),
    ("post", "/pooling", "The pooler's raw output (vLLM; pooling models)", PoolingRequest, PoolingResponse, False),
    ("post", "/score", "Score text pairs (vLLM; pooling models)", ScoreRequest, ScoreResponse, False),
    ("post", "/classify", "Class probabilities of each input (vLLM; classifiers)", ClassificationRequest,
     ClassificationResponse, False),
    ("post", "/rerank", "Order documents by relevance (Jina, Cohere; pooling models)", RerankRequest,
     RerankResponse, False),
    # (the response's output items are an untagged union msgspec cannot describe: an object here)
    ("post", "/v1/responses", "Answer a conversation (OpenAI's Responses API)", ResponsesRequest,
     dict[str, Any], True),
    ("post", "/v1/messages", "Answer a conversation (Anthropic's Messages API)", MessagesRequest, Message, True),
)
# The routes of another vendor's API answer errors in that vendor's shape.
_ERROR_TYPES: dict[str, type] = {"/v1/messages": AnthropicErrorResponse}

# Every error the routes can answer with, all in OpenAI's shape.
_ERROR_STATUSES = {
    "400": "Invalid request",
    "401": "Missing or wrong API key",
    "404": "Unknown model",
    "413": "Request body too large",
    "503": "Engine asleep, server at capacity or shutting down",
}


# Ranges the server enforces, by field (JSON Schema keywords for the non-null value).
_RANGES: dict[str, dict[str, Any]] = {
    "temperature": {"minimum": 0, "maximum": 2},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1, "maximum": MAX_TOP_K},
    "min_p": {"minimum": 0, "maximum": 1},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0, "maximum": 2},
    "seed": {"minimum": -(2**63), "maximum": 2**63 - 1},
    "n": {"minimum": 1, "maximum": MAX_N},
    "min_tokens": {"minimum": 0},
    "max_tokens": {"minimum": 0},
    "max_completion_tokens": {"minimum": 1},
    "logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    "top_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    "prompt_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    "truncate_prompt_tokens": {"minimum": 1},
    "dimensions": {"minimum": 1},
    "top_n": {"minimum": 1},
    "stop_token_ids": {"items": {"type": "integer", "minimum": 0}},
    "allowed_token_ids": {"items": {"type": "integer", "minimum": 0}},
    "logit_bias": {"additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS}},
}


def _narrow(schema: dict[str, Any], keywords: dict[str, Any]) -> None:
    """Apply ``keywords`` to the non-null branches of a property's schema."""
    branches = schema.get("anyOf", [schema])
    for branch in branches:
        if branch.get("type") in ("integer", "number"):
            branch.update({k: v for k, v in keywords.items() if k != "items" and k != "additionalProperties"})
        elif branch.get("type") == "array" and "items" in keywords:
            branch["items"] = keywords["items"]
        elif branch.get("type") == "object" and "additionalProperties" in keywords:
            branch["additionalProperties"] = keywords["additionalProperties"]


def _describe_request(schema: dict[str, Any], implemented: frozenset[str], model_names: list[str]) -> None:
    properties = schema["properties"]
    for name in list(properties):
        if name not in implemented:
            del properties[name]  # declared only to be refused unless neutral
        elif name in _RANGES:
            _narrow(properties[name], _RANGES[name])
    if "stop" in properties:
        properties["stop"] = {"anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS},
            {"type": "null"},
        ], "default": None}
    if "prompt" in properties:  # required unless prompt_embeds (an extension, behind a flag)
        ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
        properties["prompt"] = {"anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
            ids,
            {"type": "array", "items": ids, "minItems": 1},
        ]}
        schema["required"] = sorted({*schema.get("required", []), "prompt"})
    if model_names and "model" in properties:
        properties["model"] = {"anyOf": [{"enum": model_names}, {"type": "null"}], "default": None}


def openapi_document(version: str, model_names: list[str] | None = None) -> dict[str, Any]:
    """``model_names``: the names requests may use (the schema's enum for ``model``)."""
    types = [t for op in _OPERATIONS for t in op[3:5] if t is not None] + [ErrorResponse, *_ERROR_TYPES.values()]
    schemas, components = msgspec.json.schema_components(types, ref_template=REF_TEMPLATE)
    ref_of = dict(zip(types, schemas))  # a generic response's name is its instantiation's
    for request_type in (CompletionRequest, ChatCompletionRequest):
        _describe_request(components[request_type.__name__], request_type.implemented, model_names or [])
    for request_type in (ResponsesRequest, MessagesRequest):
        properties = components[ref_of[request_type]["$ref"].rsplit("/", 1)[1]]["properties"]
        if model_names:
            properties["model"] = {"enum": model_names}
    paths: dict[str, Any] = {}
    for method, path, summary, request_type, response_type, streams in _OPERATIONS:
        error_ref = ref_of[_ERROR_TYPES.get(path, ErrorResponse)]
        ok: dict[str, Any] = {"application/json": {"schema": ref_of[response_type]}}
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
                "content": {"application/json": {"schema": ref_of[request_type]}},
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
