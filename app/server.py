"""The Starlette application: routes, OpenAI-shaped errors, optional API key.

Routes: GET /health, GET /v1/models, POST /v1/completions,
POST /v1/chat/completions, the pooling routes of pooling models (POST
/v1/embeddings, vLLM's /pooling, /classify and /score, Jina/Cohere's /rerank:
app/serving/pooling.py), vLLM's POST /tokenize, POST /detokenize and
GET /version, GET /metrics (Prometheus, app/metrics.py),
GET /engine/stats (scheduler counters, for operators and tests), the control
routes of app/control.py (pause, sleep, /reset_prefix_cache...), and
the chat page (app/ui.py) unless it is disabled, and GET /openapi.json
(app/openapi.py). Every error, including unknown routes, has OpenAI's
``{"error": {...}}`` body. With an API key, every route but /health and the
page's own files requires ``Authorization: Bearer <key>``. In front of the
routes: the body limit and admission (app/limits.py), and CORS when
``allowed_origins`` is given (off by default: browsers on other origins get
no access).
"""

from __future__ import annotations

import hmac
import importlib.metadata
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.control import ControlClient, control_routes
from app.errors import (
    AuthenticationError,
    MethodNotAllowedError,
    NotFoundError,
    OpenAIError,
    ServiceUnavailableError,
    as_openai_error,
    error_body,
)
from app.limits import Admission, LimitsMiddleware, ServerLimits, ticket_of
from app.lora_adapters import LoRARegistry
from app.openapi import openapi_document
from app.protocol.common import VersionResponse
from app.responses_store import ResponsesStore
from app.serving.base import json_response
from app.serving.chat import OpenAIServingChat
from app.serving.completions import OpenAIServingCompletion
from app.serving.lora import lora_routes
from app.serving.messages import messages_routes
from app.serving.pooling import OpenAIServingPooling
from app.serving.responses import responses_routes
from app.serving.sse import EventStreamResponse, until_disconnect
from app.serving.tokenize import OpenAIServingTokenization
from app.ui import ui_routes
from core.utilities import GET_SCHEDULER_STATS

logger = logging.getLogger("ringllm.server")

Endpoint = Callable[[Request], Awaitable[Response]]
Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


def ringllm_version() -> str:
    """The installed package's version (pyproject.toml)."""
    try:
        return importlib.metadata.version("ringllm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class OpenAICORSMiddleware(CORSMiddleware):
    """Starlette's CORS, with a refused preflight in OpenAI's error shape (not plain text)."""

    def preflight_response(self, request_headers) -> Response:  # type: ignore[no-untyped-def]
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        message = f"{bytes(response.body).decode()} (allowed origins: --allowed-origins)."
        refused = json_response(error_body(message, "BadRequestError", 400), 400)
        for name, value in response.headers.items():
            if name.lower().startswith("access-control") or name.lower() == "vary":
                refused.headers[name] = value
        return refused


def error_response(exc: OpenAIError) -> Response:
    response = json_response(exc.to_response(), status=exc.status)
    if exc.headers:
        response.headers.update(exc.headers)
    return response


async def _cancel_on_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work``, cancelling it if the client hangs up first.

    A non-streaming completion can run for a long time; without this a
    client that gave up would still cost its whole generation.
    """
    gone, response = await until_disconnect(request.receive, work)
    if not gone:
        assert response is not None
        return response
    if isinstance(response, EventStreamResponse):
        await response.events.aclose()  # never started: nothing reached the engine
    return Response(status_code=499)  # nobody is listening any more


def build_app(
    engine: ControlClient,
    served_model_name: str,
    max_model_len: int,
    api_key: str | None = None,
    chat_template: str | None = None,
    *,
    model_aliases: Sequence[str] = (),
    enable_ui: bool = True,
    enable_sleep_mode: bool = False,
    enable_dev_endpoints: bool = False,
    allow_runtime_lora_updating: bool = False,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = "auto",
    reasoning_parser: str | None = "auto",
    limits: ServerLimits | None = None,
    admission: Admission | None = None,
    allowed_origins: Sequence[str] = (),
    responses_store: ResponsesStore | None = None,
) -> Starlette:
    """``admission``: the server's own (it drains on shutdown); by default a new one
    over the engine's max_num_seqs and ``limits.max_num_waiting``."""
    limits = limits or ServerLimits()
    if admission is None:
        engine_config = getattr(engine, "config", None)
        max_num_seqs = getattr(engine_config, "max_num_seqs", 1)
        admission = Admission(max_num_seqs, limits.max_num_waiting, limits.retry_after_s)
    loras = LoRARegistry(getattr(engine, "config", None), served_model_name)
    options = dict(
        engine=engine, served_model_name=served_model_name, max_model_len=max_model_len, loras=loras,
        chat_template=chat_template, model_aliases=model_aliases, enable_auto_tool_choice=enable_auto_tool_choice,
        tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
        stream_stall_timeout=limits.stream_stall_timeout,
    )
    completion = OpenAIServingCompletion(**options)
    chat = OpenAIServingChat(**options)
    tokenization = OpenAIServingTokenization(**options)
    pooling = OpenAIServingPooling(**options)
    expected_auth = f"Bearer {api_key}".encode() if api_key else None

    def openai_route(handler: Endpoint) -> Endpoint:
        """Checks the API key and turns every failure into an OpenAI error body."""

        async def endpoint(request: Request) -> Response:
            try:
                if expected_auth is not None:
                    given = request.headers.get("authorization", "").encode()
                    if not hmac.compare_digest(given, expected_auth):
                        raise AuthenticationError("Invalid or missing API key.")
                return await handler(request)
            except OpenAIError as exc:
                return error_response(exc)
            except Exception as exc:  # noqa: BLE001 - a 500 with a body beats a dropped connection
                return error_response(as_openai_error(exc))

        return endpoint

    async def health(request: Request) -> Response:
        alive = engine.engines_alive()
        if engine.is_dead or not any(alive):
            return json_response(error_body("The engine is dead.", "ServiceUnavailableError", 503), 503)
        if admission.draining:  # load balancers: send new work elsewhere
            return json_response(error_body("The server is shutting down.", "ServiceUnavailableError", 503), 503)
        if len(alive) == 1:
            return Response(status_code=200)
        # Data parallel: serving while at least one engine is; say which are down.
        engines = [{"index": j, "status": "serving" if up else "down"} for j, up in enumerate(alive)]
        return json_response({"status": "ok" if all(alive) else "degraded", "engines": engines})

    def admit_for(request: Request) -> Callable[[int], None]:
        ticket = ticket_of(request.scope)
        return ticket.admit if ticket is not None else admission.check

    async def models(request: Request) -> Response:
        return completion.list_models()

    def check_awake() -> None:
        if engine.sleeping:
            raise ServiceUnavailableError(
                "The model is asleep (POST /sleep) and serves no requests; POST /wake_up to wake it."
            )

    async def completions(request: Request) -> Response:
        check_awake()
        body = await request.body()
        return await _cancel_on_disconnect(request, completion.create_completion(body, admit_for(request)))

    async def chat_completions(request: Request) -> Response:
        check_awake()
        body = await request.body()
        return await _cancel_on_disconnect(request, chat.create_chat_completion(body, admit_for(request)))

    def pooling_route(create: Callable[[bytes, Callable[[int], None]], Awaitable[Response]]) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            check_awake()
            body = await request.body()
            return await _cancel_on_disconnect(request, create(body, admit_for(request)))

        return endpoint

    async def tokenize(request: Request) -> Response:
        return tokenization.tokenize(await request.body())

    async def detokenize(request: Request) -> Response:
        return tokenization.detokenize(await request.body())

    openapi: list[bytes] = []  # built on first use: start-up does not pay for it

    async def openapi_json(request: Request) -> Response:
        if not openapi:
            names = [served_model_name, *model_aliases]
            openapi.append(msgspec.json.encode(openapi_document(ringllm_version(), names)))
        return Response(openapi[0], media_type="application/json")

    async def version(request: Request) -> Response:
        return json_response(VersionResponse(ringllm_version()))

    async def metrics(request: Request) -> Response:
        body, content_type = engine.render_metrics()
        return Response(body, headers={"Content-Type": content_type})

    async def engine_stats(request: Request) -> Response:
        """The scheduler's snapshot; with data parallel, the engines' combined and each one's."""
        if engine.data_parallel_size == 1:
            return json_response(msgspec.structs.asdict(await engine.call(GET_SCHEDULER_STATS())))
        per_engine = await engine.call_each(GET_SCHEDULER_STATS())
        serving = [s for s in per_engine if s is not None]
        if not serving:
            raise ServiceUnavailableError("No engine is serving.")
        body = msgspec.structs.asdict(GET_SCHEDULER_STATS.combine(serving))
        body["engines"] = [
            {"index": j, "status": "down"} if s is None else {"index": j, "status": "serving", **msgspec.structs.asdict(s)}
            for j, s in enumerate(per_engine)
        ]
        return json_response(body)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}."
            error: OpenAIError = MethodNotAllowedError(message)
        elif exc.status_code == 404:
            error = NotFoundError(f"There is no route {request.method} {request.url.path}.")
        else:
            return json_response(error_body(str(exc.detail), "HTTPError", exc.status_code), exc.status_code)
        return error_response(error)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", openai_route(models), methods=["GET"]),
        Route("/v1/completions", openai_route(completions), methods=["POST"]),
        Route("/v1/chat/completions", openai_route(chat_completions), methods=["POST"]),
        Route("/v1/embeddings", openai_route(pooling_route(pooling.create_embedding)), methods=["POST"]),
        Route("/pooling", openai_route(pooling_route(pooling.create_pooling)), methods=["POST"]),
        Route("/classify", openai_route(pooling_route(pooling.create_classification)), methods=["POST"]),
        *(
            Route(path, openai_route(pooling_route(pooling.create_score)), methods=["POST"])
            for path in ("/score", "/v1/score")
        ),
        *(
            Route(path, openai_route(pooling_route(pooling.create_rerank)), methods=["POST"])
            for path in ("/rerank", "/v1/rerank", "/v2/rerank")
        ),
        Route("/tokenize", openai_route(tokenize), methods=["POST"]),
        Route("/detokenize", openai_route(detokenize), methods=["POST"]),
        Route("/version", openai_route(version), methods=["GET"]),
        Route("/openapi.json", openai_route(openapi_json), methods=["GET"]),
        Route("/metrics", openai_route(metrics), methods=["GET"]),
        Route("/engine/stats", openai_route(engine_stats), methods=["GET"]),
    ]
    if allow_runtime_lora_updating:
        routes += lora_routes(engine, loras, openai_route)
    routes += messages_routes(chat, api_key, admit_for, check_awake, _cancel_on_disconnect)
    routes += responses_routes(
        chat, responses_store or ResponsesStore(), openai_route, admit_for, check_awake, _cancel_on_disconnect
    )
    routes += control_routes(
        engine, openai_route, enable_sleep_mode=enable_sleep_mode, enable_dev_endpoints=enable_dev_endpoints
    )
    if enable_ui:
        routes += ui_routes(api_key_required=expected_auth is not None)
    middleware = []
    if allowed_origins:
        middleware.append(
            Middleware(OpenAICORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"])
        )
    middleware.append(Middleware(LimitsMiddleware, admission=admission, max_body_bytes=limits.max_request_body_bytes))
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error}, middleware=middleware)
    app.state.admission = admission
    return app


def tag_responses(app: ASGIApp, client_index: int) -> ASGIApp:
    """Every HTTP response says which API server process answered (x-ringllm-api-server:
    "<index> pid=<pid>"): for debugging a deployment, and for tests."""
    header = (b"x-ringllm-api-server", f"{client_index} pid={os.getpid()}".encode())

    async def tagged(scope: Scope, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def send_tagged(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        await app(scope, receive, send_tagged)

    return tagged
