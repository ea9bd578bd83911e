"""The OpenAI endpoints: /v1/completions, /v1/chat/completions and /v1/models.

A handler decodes and checks the request, builds the prompt's token ids,
asks the InputProcessor for a validated EngineCoreRequest, then either
collects the whole output or streams it as server-sent events. Everything
that is wrong with a request is reported before generation starts, as an
HTTP error; a failure during a stream becomes an ``error`` event (which
OpenAI's clients raise as APIError) that ends the stream without [DONE].

The engine is an ``EngineClient`` (``AsyncLLM``): ``generate(request)`` is an
async generator of RequestOutput deltas that aborts the request when it is
closed early. A client that hangs up is noticed by one watcher,
``until_disconnect``, for streamed and whole responses alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app.errors import BadRequestError, InternalServerError, NotFoundError, OpenAIError
from app.input_processor import InputProcessor
from app.output_processor import RequestOutput
from app.protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    UsageInfo,
    now,
    random_id,
)
from core.protocol import EngineCoreRequest, EngineDeadError, SchedulerStats

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("ringllm.serving")
T = TypeVar("T")

_encoder = msgspec.json.Encoder()
DONE_EVENT = b"data: [DONE]\n\n"


class EngineClient(Protocol):
    """What the HTTP layer needs from the engine (implemented by ``AsyncLLM``)."""

    input_processor: InputProcessor
    chat_template: str | None

    @property
    def is_dead(self) -> bool: ...

    def generate(self, request: EngineCoreRequest) -> AsyncGenerator[RequestOutput, None]: ...

    async def get_scheduler_stats(self) -> SchedulerStats: ...

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool: ...


def json_response(body: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(body), status_code=status, media_type="application/json")


def sse_event(body: Any) -> bytes:
    return b"data: " + _encoder.encode(body) + b"\n\n"


def as_openai_error(exc: BaseException) -> OpenAIError:
    """The error to show the client for a failure during generation."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return InternalServerError(f"The engine is dead: {exc}")
    logger.error("request failed", exc_info=exc)
    return InternalServerError(f"{type(exc).__name__}: {exc}")


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run ``work`` until it ends or the client hangs up, whichever comes first.

    Returns ``(client_gone, result)``: when the client left first, ``work``
    was cancelled and the result is None (unless it had finished too).
    Exceptions of ``work`` propagate while the client is still there. Call
    only after the request body has been read: this consumes ``receive``.
    """
    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((work_task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work_task, watch):
            task.cancel()
        await asyncio.gather(work_task, watch, return_exceptions=True)
    gone = watch.done() and not watch.cancelled()
    if gone:
        finished = not work_task.cancelled() and work_task.exception() is None
        return True, work_task.result() if finished else None
    return False, work_task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(Response):
    """Server-sent events that stop as soon as the client goes away.

    The events are sent while ``until_disconnect`` watches for the client
    leaving; the generator is closed either way, so the request is aborted
    in the engine promptly instead of when the next send fails (or never,
    on a server that drops sends to closed connections silently).
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        # No Response.__init__: it would render a body and announce its length.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            await until_disconnect(receive, self._pump(send))
        finally:
            await self.events.aclose()

    async def _pump(self, send: Send) -> None:
        async for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _decode(body: bytes, request_type: type) -> Any:
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        raise BadRequestError(f"Invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequestError(f"The request body is not valid JSON: {exc}") from None


class OpenAIServing:
    """Implements the OpenAI routes on top of an AsyncLLM-like engine."""

    def __init__(
        self,
        engine: EngineClient,
        served_model_name: str,
        max_model_len: int,
        chat_template: str | None = None,
        model_aliases: Sequence[str] = (),
    ) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        # Other names requests may use (not listed by /v1/models, which would
        # show one model twice); responses always carry the served name.
        self.accepted_model_names = frozenset((served_model_name, *model_aliases))
        self.max_model_len = max_model_len
        # The server-wide --chat-template; a request's own chat_template wins.
        self.chat_template = chat_template if chat_template is not None else engine.chat_template
        self.created = now()

    @property
    def input_processor(self) -> InputProcessor:
        return self.engine.input_processor

    # ------------------------------------------------------------------ models

    def list_models(self) -> Response:
        card = ModelCard(id=self.served_model_name, created=self.created, max_model_len=self.max_model_len)
        return json_response(ModelList(data=[card]))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_model_names:
            raise NotFoundError(f"The model `{model}` does not exist.", "model")

    def _check_alive(self) -> None:
        if self.engine.is_dead:
            raise InternalServerError("The engine is dead; this server can no longer generate.")

    def _engine_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        req: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        prompt_embeds: torch.Tensor | None = None,
        extra_stop: Sequence[str] = (),
    ) -> EngineCoreRequest:
        if max_tokens is None:
            max_tokens = self.input_processor.default_max_tokens(len(prompt_ids))
        params = req.sampling_params(max_tokens)
        if extra_stop:
            params.stop = params.stop + [s for s in extra_stop if s not in params.stop]
        try:
            return self.input_processor.process(
                request_id, prompt_ids, params, req.priority, req.cache_salt, prompt_embeds
            )
        except ValueError as exc:
            raise BadRequestError(str(exc), getattr(exc, "param", None)) from None

    # ------------------------------------------------------------- completions

    async def create_completion(self, body: bytes) -> Response:
        req: CompletionRequest = _decode(body, CompletionRequest)
        self._check_model(req.model)
        req.check_supported()
        self._check_alive()
        request_id = random_id("cmpl")
        prompt_ids: list[int] = []
        prompt_embeds = None
        try:
            if (embeds_b64 := req.single_prompt_embeds()) is not None:
                prompt_embeds = self.input_processor.load_prompt_embeds(embeds_b64)
            else:
                prompt_ids = self.input_processor.tokenize_prompt(req.single_prompt())
        except ValueError as exc:
            param = "prompt" if prompt_embeds is None and req.prompt_embeds is None else "prompt_embeds"
            raise BadRequestError(str(exc), param) from None
        num_prompt = len(prompt_ids) if prompt_embeds is None else int(prompt_embeds.shape[0])
        max_tokens = req.max_tokens
        if max_tokens is None:  # OpenAI's default, shortened to what fits
            room = self.input_processor.default_max_tokens(num_prompt)
            max_tokens = max(min(COMPLETION_DEFAULT_MAX_TOKENS, room), 1)
        engine_request = self._engine_request(request_id, prompt_ids, req, max_tokens, prompt_embeds)
        if req.stream:
            return EventStreamResponse(self._stream_completion(engine_request, req.include_usage))
        text, last = await self._collect(engine_request)
        choice = CompletionChoice(
            index=0, text=text, finish_reason=last.finish_reason, stop_reason=last.stop_reason
        )
        return json_response(
            CompletionResponse(
                id=request_id,
                created=now(),
                model=self.served_model_name,
                choices=[choice],
                usage=_usage(last),
            )
        )

    def _stream_completion(
        self, request: EngineCoreRequest, include_usage: bool
    ) -> AsyncGenerator[bytes, None]:
        created = now()

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> bytes:
            return sse_event(
                CompletionResponse(
                    id=request.request_id, created=created, model=self.served_model_name,
                    choices=choices, usage=usage,
                )
            )

        def choice(out: RequestOutput) -> CompletionChoice:
            return CompletionChoice(0, out.text, None, out.finish_reason, out.stop_reason)

        return self._stream_events(request, include_usage, chunk, choice)

    # -------------------------------------------------------- chat completions

    async def create_chat_completion(self, body: bytes) -> Response:
        req: ChatCompletionRequest = _decode(body, ChatCompletionRequest)
        self._check_model(req.model)
        req.check_supported()
        self._check_alive()
        request_id = random_id("chatcmpl")
        messages = [m.to_template_dict() for m in req.messages]
        template = req.chat_template if req.chat_template is not None else self.chat_template
        try:
            prompt_ids = self.input_processor.apply_chat_template(
                messages, template, req.add_generation_prompt, **(req.chat_template_kwargs or {})
            )
        except ValueError as exc:
            raise BadRequestError(str(exc), "messages") from None
        # The model's own template may declare what ends a turn; like an
        # end-of-turn token, that does not apply under ignore_eos.
        turn_stop = self.input_processor.chat_stop if template is None and not req.ignore_eos else ()
        engine_request = self._engine_request(
            request_id, prompt_ids, req, req.requested_max_tokens, extra_stop=turn_stop
        )
        if req.stream:
            return EventStreamResponse(self._stream_chat(engine_request, req.include_usage))
        text, last = await self._collect(engine_request)
        choice = ChatChoice(
            index=0,
            message=AssistantMessage(content=text),
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
        )
        return json_response(
            ChatCompletionResponse(
                id=request_id,
                created=now(),
                model=self.served_model_name,
                choices=[choice],
                usage=_usage(last),
            )
        )

    def _stream_chat(
        self, request: EngineCoreRequest, include_usage: bool
    ) -> AsyncGenerator[bytes, None]:
        created = now()

        def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> bytes:
            return sse_event(
                ChatCompletionChunk(
                    id=request.request_id, created=created, model=self.served_model_name,
                    choices=choices, usage=usage,
                )
            )

        def choice(out: RequestOutput) -> ChatChunkChoice:
            delta = DeltaMessage(content=out.text) if out.text else DeltaMessage()
            return ChatChunkChoice(0, delta, None, out.finish_reason, out.stop_reason)

        opening = chunk([ChatChunkChoice(0, DeltaMessage(role="assistant", content=""))])
        return self._stream_events(request, include_usage, chunk, choice, opening)

    # ----------------------------------------------------------------- engine

    async def _stream_events(
        self,
        request: EngineCoreRequest,
        include_usage: bool,
        chunk: Callable[..., bytes],
        choice: Callable[[RequestOutput], Any],
        opening: bytes | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """The SSE body of one request: ``opening`` if any, a chunk per delta with
        text (or the finish), usage if asked for, then ``[DONE]``. A failure after
        the response has started becomes an error event in OpenAI's format."""
        try:
            if opening is not None:
                yield opening
            last = None
            async with self._outputs(request) as outputs:
                async for out in outputs:
                    _check_output(out)
                    last = out
                    if out.text or out.finished:
                        yield chunk([choice(out)])
            if include_usage and last is not None:
                yield chunk([], _usage(last))
            yield DONE_EVENT
        except Exception as exc:  # noqa: BLE001 - reported to the client as an event
            yield sse_event(as_openai_error(exc).to_response())

    def _outputs(self, request: EngineCoreRequest) -> contextlib.aclosing:
        """The request's output deltas, to iterate in ``async with``.

        Closing the engine's generator early is what aborts the request in the
        engine; ``aclosing`` makes sure that happens even when our consumer is
        itself closed at a ``yield`` (client gone) rather than by an exception.
        """
        return contextlib.aclosing(self.engine.generate(request))

    async def _collect(self, request: EngineCoreRequest) -> tuple[str, RequestOutput]:
        parts: list[str] = []
        last: RequestOutput | None = None
        try:
            async with self._outputs(request) as outputs:
                async for out in outputs:
                    _check_output(out)
                    parts.append(out.text)
                    last = out
        except Exception as exc:
            raise as_openai_error(exc) from exc
        if last is None:
            raise InternalServerError("The engine finished the request without any output.")
        return "".join(parts), last


def _check_output(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        raise InternalServerError("The engine failed while generating this request.")


def _usage(out: RequestOutput) -> UsageInfo:
    return UsageInfo.of(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
