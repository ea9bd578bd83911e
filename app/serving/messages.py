"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat serving.

A request is translated into the chat request it amounts to (app/protocol/messages.py) and runs
through ``OpenAIServingChat.prepare`` and ``stream``, so the template, tool calls (forced or
parsed in the model's own syntax) and reasoning are chat's. One ``MessageAssembler`` turns the
parsed deltas into content blocks, thinking, text and tool_use in the order the model wrote
them, and into stream events: a whole message is what its stream adds up to. The routes have
their own wrapper: Anthropic's clients authenticate with ``x-api-key`` (or a Bearer token) and
read errors as ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from http import HTTPStatus
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.choices import Choice
from app.errors import AuthenticationError, BadRequestError, OpenAIError, StreamTimeoutError, as_openai_error
from app.output_processor import RequestOutput
from app.parsing.output import OutputDelta
from app.protocol.messages import (
    ContentBlock,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    ErrorDetail,
    ErrorResponse,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessagesRequest,
    MessageStart,
    MessageStop,
    Ping,
    StopDelta,
    StreamEvent,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    TokenCount,
    ToolUseBlock,
    Usage,
)
from app.protocol.chat import ChatCompletionRequest
from app.serving.base import Admit, decode_request, json_response
from app.serving.chat import OpenAIServingChat
from app.serving.sse import EventStreamResponse

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
# Seconds a stream may go without an event before a ping is sent: a long prompt's prefill, or a
# server with every slot taken, shows the client the connection is alive.
PING_INTERVAL_S = 10.0

# Anthropic's error type for each HTTP status this server reports.
_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    HTTPStatus.SERVICE_UNAVAILABLE: "overloaded_error",
    HTTPStatus.GATEWAY_TIMEOUT: "timeout_error",
}

# Chat's names for the fields a chat-side check may complain about, as a Messages client knows them.
_PARAMS = {"stop": "stop_sequences", "response_format": "output_config.format"}


def anthropic_error(exc: OpenAIError) -> ErrorResponse:
    kind = _ERROR_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
    return ErrorResponse(ErrorDetail(kind, exc.message))


def error_response(exc: OpenAIError) -> Response:
    response = json_response(anthropic_error(exc), status=exc.status)
    if exc.headers:
        response.headers.update(exc.headers)
    return response


def sse(event: StreamEvent | ErrorResponse) -> bytes:
    """An event with its name on an ``event:`` line, which Anthropic's clients dispatch on."""
    name = event.__struct_config__.tag
    return b"event: " + str(name).encode() + b"\ndata: " + _encoder.encode(event) + b"\n\n"


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class MessageAssembler:
    """One message's content blocks, built from the parsed deltas of its output, with the
    stream events that build the same blocks in a client.

    A block opens when the output turns to another part (thinking, text, a new tool call)
    and closes when the next opens or the output ends. Text that is only whitespace is held
    back until real text follows: around tool calls it is no answer (as chat's parser drops
    it), and is shown at the end only when there was no call at all."""

    def __init__(self, omit_thinking: bool = False) -> None:
        self.omit_thinking = omit_thinking  # thinking: {display: "omitted"}: blocks without their text
        self.blocks: list[ContentBlock] = []
        self._open = False
        self._held = ""
        self._arguments: dict[int, list[str]] = {}  # block index -> the call's JSON in pieces
        self._calls: dict[int, int] = {}  # chat's call index -> block index

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def feed(self, delta: OutputDelta) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if delta.reasoning:
            index = self._enter(ThinkingBlock, events)
            if not self.omit_thinking:
                block = self.blocks[index]
                assert isinstance(block, ThinkingBlock)
                block.thinking += delta.reasoning
                events.append(ContentBlockDelta(index, ThinkingDelta(delta.reasoning)))
        if delta.content:
            text = self._held + delta.content
            in_text = self._open and isinstance(self.blocks[-1], TextBlock)
            if in_text or text.strip():
                self._held = ""
                self._add_text(text, events)
            else:
                self._held = text
        for part in delta.tool_calls:
            function = part.function
            if part.index not in self._calls:
                assert function is not None and function.name is not None
                self._close(events)
                self._start(ToolUseBlock(new_tool_use_id(), function.name, {}), events)
                self._calls[part.index] = len(self.blocks) - 1
                self._arguments[len(self.blocks) - 1] = []
            if function is not None and function.arguments:
                index = self._calls[part.index]
                self._arguments[index].append(function.arguments)
                events.append(ContentBlockDelta(index, InputJsonDelta(function.arguments)))
        return events

    def finish(self) -> list[StreamEvent]:
        """The last events; every tool_use block gets its input (what its JSON says, or {}
        for arguments cut short by max_tokens)."""
        events: list[StreamEvent] = []
        if self._held and not self._calls:
            self._add_text(self._held, events)
        self._held = ""
        self._close(events)
        for index, pieces in self._arguments.items():
            block = self.blocks[index]
            assert isinstance(block, ToolUseBlock)
            block.input = _tool_input("".join(pieces))
        return events

    def _add_text(self, text: str, events: list[StreamEvent]) -> None:
        index = self._enter(TextBlock, events)
        block = self.blocks[index]
        assert isinstance(block, TextBlock)
        block.text += text
        events.append(ContentBlockDelta(index, TextDelta(text)))

    def _enter(self, kind: type[TextBlock] | type[ThinkingBlock], events: list[StreamEvent]) -> int:
        """The index of the open block of this kind, opened now if another is open."""
        if not (self._open and isinstance(self.blocks[-1], kind)):
            self._close(events)
            self._start(kind(""), events)
        return len(self.blocks) - 1

    def _start(self, block: ContentBlock, events: list[StreamEvent]) -> None:
        self.blocks.append(block)
        self._open = True
        # The event carries the block as it starts (empty), not the one that grows.
        events.append(ContentBlockStart(len(self.blocks) - 1, msgspec.structs.replace(block)))

    def _close(self, events: list[StreamEvent]) -> None:
        if self._open:
            events.append(ContentBlockStop(len(self.blocks) - 1))
            self._open = False


async def paced(
    source: AsyncGenerator[T, None], ping_every: float, stall_timeout: float | None = None
) -> AsyncGenerator[T | None, None]:
    """The items of ``source``, with None (time for a ping) whenever ``ping_every`` seconds
    pass without one; StreamTimeoutError once ``stall_timeout`` seconds pass without one
    (--stream-stall-timeout, which pings must not defeat). Closing this closes ``source``,
    so its requests are aborted."""
    loop = asyncio.get_running_loop()
    pending: asyncio.Future[T] | None = None
    since = loop.time()
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(source.__anext__())
                since = loop.time()
            wait = ping_every if stall_timeout is None else min(ping_every, since + stall_timeout - loop.time())
            await asyncio.wait((pending,), timeout=max(wait, 0.0))
            if pending.done():
                done, pending = pending, None
                try:
                    item = done.result()
                except StopAsyncIteration:
                    return
                yield item
            elif stall_timeout is not None and loop.time() - since >= stall_timeout:
                raise StreamTimeoutError(
                    f"No output for {stall_timeout:g} s (--stream-stall-timeout); the request was aborted."
                )
            else:
                yield None
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await source.aclose()


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(out: RequestOutput, called: bool, stop_sequences: list[str] | None, clamped: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished output. ``clamped``: max_tokens was more than
    the context window had room for, so running out of tokens is running out of window."""
    if out.finish_reason == "length":
        return ("model_context_window_exceeded" if clamped else "max_tokens"), None
    if called:
        return "tool_use", None
    if isinstance(out.stop_reason, str) and out.stop_reason in (stop_sequences or ()):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def _usage(choice: Choice, out: RequestOutput) -> Usage:
    return Usage.of(choice.request.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)


class ServingMessages:
    """The Messages API on top of the chat serving (its template, model names, parsers)."""

    def __init__(self, chat: OpenAIServingChat, ping_interval: float | None = None) -> None:
        self.chat = chat
        self.ping_interval = PING_INTERVAL_S if ping_interval is None else ping_interval

    def _open(self, body: bytes) -> tuple[MessagesRequest, ChatCompletionRequest]:
        req = decode_request(body, MessagesRequest)
        self.chat._check_model(req.model)
        chat_req = req.to_chat()
        try:
            chat_req.check_supported()
        except BadRequestError as exc:
            param = _PARAMS.get(exc.param or "", exc.param)
            raise BadRequestError(exc.message, param) from None
        return req, chat_req

    def count_tokens(self, body: bytes) -> Response:
        """The prompt's length as the chat template renders it: system, tools and turns."""
        _, chat_req = self._open(body)
        return json_response(TokenCount(len(self.chat._render_chat(chat_req))))

    def _fit(self, req: MessagesRequest, chat_req: ChatCompletionRequest) -> bool:
        """Cuts max_tokens to the room the context window leaves after the prompt (Anthropic's
        clients ask for as much as their models can write); True when it did."""
        assert req.max_tokens is not None
        room = self.chat.max_model_len - len(self.chat._render_chat(chat_req))
        if 1 <= room < req.max_tokens:
            chat_req.max_tokens = room
            return True
        return False

    async def create_message(self, body: bytes, admit: Admit | None = None) -> Response:
        req, chat_req = self._open(body)
        if req.max_tokens is None:
            raise BadRequestError("max_tokens: Field required.", "max_tokens")
        self.chat._check_alive()
        clamped = self._fit(req, chat_req)
        message_id = f"msg_{uuid.uuid4().hex}"
        gen = self.chat.prepare(chat_req, message_id, admit)
        source = await self.chat.stream(gen)
        reply = _Reply(req, gen.choices, message_id, self.chat.response_model(req.model), clamped)
        if req.stream:
            # The stall timeout is kept by ``paced`` (it ends the stream with an Anthropic error event).
            return EventStreamResponse(reply.events(paced(source, self.ping_interval, self.chat.stream_stall_timeout)))
        async with contextlib.aclosing(source):
            async for _, out, delta in source:
                reply.add(out, delta)
        reply.assembler.finish()
        return json_response(reply.message())


class _Reply:
    """One message on its way: its blocks (``assembler``), its one choice and last output."""

    def __init__(self, req: MessagesRequest, choices: list[Choice], message_id: str, model: str, clamped: bool) -> None:
        self.req = req
        self.id = message_id
        self.model = model
        self.clamped = clamped
        self.assembler = MessageAssembler(req.omit_thinking)
        (self.choice,) = choices
        self.last: RequestOutput | None = None

    def add(self, out: RequestOutput, delta: OutputDelta) -> list[StreamEvent]:
        self.last = out
        return self.assembler.feed(delta)

    def usage(self) -> Usage:
        if self.last is None:
            return Usage(self.choice.request.num_prompt_tokens, 0)
        return _usage(self.choice, self.last)

    def message(self) -> Message:
        reason, sequence = (None, None)
        if self.last is not None and self.last.finished:
            reason, sequence = stop_reason(self.last, self.assembler.num_calls > 0, self.req.stop_sequences,
                                           self.clamped)
        return Message(self.id, self.model, self.assembler.blocks, reason, sequence, self.usage())

    def _start(self) -> MessageStart:
        usage = self.usage()
        usage.output_tokens = 0
        return MessageStart(Message(self.id, self.model, [], None, None, usage))

    async def events(
        self, source: AsyncGenerator[tuple[Choice, RequestOutput, OutputDelta] | None, None]
    ) -> AsyncGenerator[bytes, None]:
        """message_start once the prompt is in (its usage then knows the cached tokens) or
        when a ping is due before that, a ping, the blocks' events, message_delta with the
        stop reason and the totals (which replace message_start's), message_stop; a ping for
        each None of ``source`` (``paced``); a failure on the way becomes an ``error`` event."""
        started = False
        try:
            async with contextlib.aclosing(source):
                async for item in source:
                    if item is None:
                        if not started:
                            yield sse(self._start())
                            started = True
                        yield sse(Ping())
                        continue
                    _, out, delta = item
                    if not started:
                        self.last = out
                        yield sse(self._start())
                        yield sse(Ping())
                        started = True
                    for event in self.add(out, delta):
                        yield sse(event)
            if not started:
                yield sse(self._start())
            for event in self.assembler.finish():
                yield sse(event)
            final = self.message()
            yield sse(MessageDelta(StopDelta(final.stop_reason, final.stop_sequence), final.usage))
            yield sse(MessageStop())
        except Exception as exc:  # noqa: BLE001 - reported to the client as an event
            yield sse(anthropic_error(as_openai_error(exc)))


def messages_routes(
    chat: OpenAIServingChat,
    api_key: str | None,
    admit_for: Callable[[Request], Admit],
    check_awake: Callable[[], None],
    until_done: Callable[[Request, Awaitable[Response]], Awaitable[Response]],
) -> list[Route]:
    """POST /v1/messages and /v1/messages/count_tokens (``?beta=true``, which Anthropic's beta
    client adds, changes nothing). ``until_done`` runs a generation, cancelling it if the
    client hangs up (the server's ``_cancel_on_disconnect``)."""
    serving = ServingMessages(chat)
    expected = api_key.encode() if api_key else None

    def authenticate(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("x-api-key")
        if given is None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            given = token if scheme.lower() == "bearer" else ""
        if not hmac.compare_digest(given.encode(), expected):
            raise AuthenticationError("Invalid or missing API key (x-api-key or Authorization: Bearer).")

    def anthropic_route(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                authenticate(request)
                return await handler(request)
            except OpenAIError as exc:
                return error_response(exc)
            except Exception as exc:  # noqa: BLE001 - a 500 with a body beats a dropped connection
                return error_response(as_openai_error(exc))

        return endpoint

    async def create(request: Request) -> Response:
        check_awake()
        body = await request.body()
        return await until_done(request, serving.create_message(body, admit_for(request)))

    async def count_tokens(request: Request) -> Response:
        return serving.count_tokens(await request.body())

    return [
        Route("/v1/messages", anthropic_route(create), methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic_route(count_tokens), methods=["POST"]),
    ]
