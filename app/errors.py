"""Errors the HTTP layer turns into OpenAI-shaped JSON bodies.

OpenAI clients decide which exception to raise from the HTTP status and read
``error.message`` from the body, so every failure the server reports goes
through :class:`OpenAIError` (or :func:`error_body` for a mid-stream event).
"""

from __future__ import annotations

import logging
from http import HTTPStatus

import msgspec

from core.protocol import EngineDeadError, EngineUnavailableError

logger = logging.getLogger("ringllm.serving")


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class OpenAIError(Exception):
    """A failure to report to the client with an HTTP status and OpenAI error type."""

    status: HTTPStatus = HTTPStatus.INTERNAL_SERVER_ERROR
    type: str = "InternalServerError"

    def __init__(self, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers  # extra response headers (Retry-After)

    def to_response(self) -> ErrorResponse:
        return error_body(self.message, self.type, self.status, self.param)


class BadRequestError(OpenAIError):
    status = HTTPStatus.BAD_REQUEST
    type = "BadRequestError"


class AuthenticationError(OpenAIError):
    status = HTTPStatus.UNAUTHORIZED
    type = "AuthenticationError"


class NotFoundError(OpenAIError):
    status = HTTPStatus.NOT_FOUND
    type = "NotFoundError"


class MethodNotAllowedError(OpenAIError):
    status = HTTPStatus.METHOD_NOT_ALLOWED
    type = "MethodNotAllowedError"


class PayloadTooLargeError(OpenAIError):
    """The body is over --max-request-body-bytes; refused before it is read whole."""

    status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    type = "PayloadTooLargeError"


class ConflictError(OpenAIError):
    """The request is valid but the server's current state does not allow it."""

    status = HTTPStatus.CONFLICT
    type = "ConflictError"


class InternalServerError(OpenAIError):
    status = HTTPStatus.INTERNAL_SERVER_ERROR
    type = "InternalServerError"


class ServiceUnavailableError(OpenAIError):
    """The server is up but cannot serve this now (the engine is asleep, the queue
    is full, the server is shutting down)."""

    status = HTTPStatus.SERVICE_UNAVAILABLE
    type = "ServiceUnavailableError"


class StreamTimeoutError(OpenAIError):
    """A stream produced nothing for --stream-stall-timeout seconds (an error event)."""

    status = HTTPStatus.GATEWAY_TIMEOUT
    type = "TimeoutError"


def error_body(
    message: str, type: str, status: HTTPStatus | int, param: str | None = None
) -> ErrorResponse:
    return ErrorResponse(ErrorInfo(message=message, type=type, param=param, code=int(status)))


def as_openai_error(exc: BaseException) -> OpenAIError:
    """The error to show the client for a failure during generation."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineUnavailableError):
        return ServiceUnavailableError(f"No engine can take this request now: {exc}")
    if isinstance(exc, EngineDeadError):
        return InternalServerError(f"The engine is dead: {exc}")
    logger.error("request failed", exc_info=exc)
    return InternalServerError(f"{type(exc).__name__}: {exc}")
