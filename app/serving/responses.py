"""/v1/responses: OpenAI's Responses API over the chat machinery, whole or streamed, stored or not.

A request becomes a ``ChatCompletionRequest`` (instructions as the system
message, the items of ``previous_response_id``'s conversation then the new
input as messages, flat function tools as chat tools, ``text.format`` as
``response_format``, ``reasoning.effort`` as thinking on or off) and goes
through ``OpenAIServingChat.prepare/collect/stream``: the same template,
grammar and output parsers as chat. What comes out is laid out as output
items (reasoning, message, function calls) by one ``OutputAssembler`` for the
whole and the streamed response alike, the stream sending OpenAI's events
(``event:`` lines, strictly rising ``sequence_number``) as the items grow.

A response is stored (app/responses_store.py) only once it is complete or
incomplete: a failed generation keeps nothing.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.errors import BadRequestError, NotFoundError, OpenAIError, as_openai_error
from app.output_processor import RequestOutput
from app.parsing.output import OutputDelta
from app.protocol.chat import (
    ChatCompletionRequest,
    ChatMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolCall,
    ToolDefinition,
)
from app.protocol.common import now
from app.protocol.responses import (
    DeletedResponse,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    IncompleteDetails,
    InputItem,
    InputTokensDetails,
    InputTokensResponse,
    MessageItem,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
    TextFormat,
    content_text,
    InputItemList,
    decode_items,
    error_path,
    new_id,
    with_ids,
)
from app.protocol.sampling import JsonSchemaFormat, ResponseFormat
from app.responses_store import ResponsesStore
from app.serving.base import Admit, decode_request, json_response
from app.serving.chat import ChatGeneration, OpenAIServingChat
from app.serving.sse import EventStreamResponse

logger = logging.getLogger("ringllm.responses")

_encoder = msgspec.json.Encoder()
Endpoint = Callable[[Request], Awaitable[Response]]

# Chat's names for the fields a Responses request calls otherwise (for errors).
_PARAM_NAMES = {
    "messages": "input",
    "response_format": "text.format",
    "structured_outputs": "text.format",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
}


class OpenAIServingResponses:
    """The Responses routes' work: requests through ``chat``, responses kept in ``store``."""

    def __init__(self, chat: OpenAIServingChat, store: ResponsesStore) -> None:
        self.chat = chat
        self.store = store
        self._ignored_tool_types: set[str] = set()  # logged once each

    # ------------------------------------------------------------------ requests

    async def _open(self, body: bytes) -> Turn:
        """The request decoded and checked, its conversation read back from the store."""
        req = _decode(body)
        for name in req.check_supported():
            logger.debug("ignoring %s: %s", name, ResponsesRequest.IGNORED[name])
        if req.reasoning is not None and (req.reasoning.summary or req.reasoning.generate_summary):
            logger.debug("ignoring reasoning.summary: the reasoning is returned whole, not summarized")
        self.chat._check_model(req.model)
        history = await self._history(req.previous_response_id)
        items = decode_items(req.input)
        if not items and not history:
            raise BadRequestError("input must not be empty.", "input")
        tools = self._function_tools(req.tools)
        messages = chat_messages(req.instructions, history, items)
        return Turn(req, history, items, tools, self._chat_request(req, messages, tools))

    async def _history(self, previous_response_id: str | None) -> list[InputItem]:
        if previous_response_id is None:
            return []
        stored = await self.store.get(previous_response_id)
        if stored is None:
            raise NotFoundError(f"Previous response with id '{previous_response_id}' not found.",
                                "previous_response_id")
        return decode_items(msgspec.json.decode(stored.conversation))

    def _function_tools(self, tools: list[dict[str, Any]] | None) -> list[FunctionTool]:
        """The function tools; other kinds (web search, MCP, shell...) run on OpenAI's side
        and cannot here: they are left out, with a log line the first time."""
        functions = []
        for i, tool in enumerate(tools or ()):
            kind = tool.get("type")
            if kind != "function":
                if kind not in self._ignored_tool_types:
                    self._ignored_tool_types.add(str(kind))
                    logger.info("ignoring tools of type %r: this server can only hand function calls back", kind)
                continue
            try:
                function = msgspec.convert(tool, FunctionTool)
            except msgspec.ValidationError as exc:
                raise BadRequestError(f"tools[{i}]: {exc}", error_path(f"tools[{i}]", exc)) from None
            _check_function_tool(function, i)
            functions.append(function)
        return functions

    def _chat_request(
        self, req: ResponsesRequest, messages: list[ChatMessage], tools: list[FunctionTool]
    ) -> ChatCompletionRequest:
        names = {t.name for t in tools}
        tool_choice = _chat_tool_choice(req.tool_choice, names)
        response_format = _response_format(req.text)
        forced = bool(tools) and (tool_choice == "required" or isinstance(tool_choice, NamedToolChoice))
        if forced:  # the output is a call, not text: text.format has nothing to shape (as OpenAI's)
            response_format = None
        chat = ChatCompletionRequest(
            messages=messages,
            model=req.model,
            max_completion_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=req.seed,
            repetition_penalty=req.repetition_penalty,
            stop=req.stop,
            ignore_eos=req.ignore_eos,
            priority=req.priority,
            cache_salt=req.cache_salt,
            tools=[_chat_tool(t) for t in tools] or None,
            tool_choice=tool_choice,
            parallel_tool_calls=req.parallel_tool_calls,
            response_format=response_format,
            reasoning_effort=req.chat_reasoning_effort,
        )
        with _responses_params():
            chat.check_supported()
        return chat

    def _prepare(self, turn: Turn, admit: Admit | None) -> ChatGeneration:
        self.chat._check_alive()
        with _responses_params():
            return self.chat.prepare(turn.chat, turn.engine_id, admit)

    # ------------------------------------------------------------------ routes

    async def create(self, body: bytes, admit: Admit | None = None) -> Response:
        turn = await self._open(body)
        gen = self._prepare(turn, admit)
        if turn.req.stream:
            with _responses_params():
                deltas = await self.chat.stream(gen)
            return EventStreamResponse(self._events(turn, gen, deltas), self.chat.stream_stall_timeout)
        with _responses_params():
            ((out, parsed),) = await self.chat.collect(gen)
        assembler = OutputAssembler(EventSequence())
        assembler.feed(OutputDelta(parsed.reasoning or "", parsed.content or "", [
            DeltaToolCall(i, call.id, "function", DeltaFunctionCall(call.function.name, call.function.arguments))
            for i, call in enumerate(parsed.tool_calls)
        ]))
        assembler.finish(out.finish_reason == "length")
        response = self._response(turn, gen, assembler.items, out, parsed.reasoning_tokens)
        body_bytes = _encoder.encode(response)
        await self._keep(turn, response, body_bytes)
        return Response(body_bytes, media_type="application/json")

    async def _events(
        self, turn: Turn, gen: ChatGeneration, deltas: AsyncGenerator[Any, None]
    ) -> AsyncGenerator[bytes, None]:
        events = EventSequence()
        assembler = OutputAssembler(events)
        opening = self._response(turn, gen, [], None)
        yield events.event("response.created", response=opening)
        yield events.event("response.in_progress", response=opening)
        last: RequestOutput | None = None
        try:
            async with contextlib.aclosing(deltas):
                async for _, out, delta in deltas:
                    last = out
                    for event in assembler.feed(delta):
                        yield event
            assert last is not None and last.finished, "the engine's output ended unfinished"
            for event in assembler.finish(last.finish_reason == "length"):
                yield event
            reasoning_tokens = gen.parsers[gen.choices[0].index].parsed().reasoning_tokens
            response = self._response(turn, gen, assembler.items, last, reasoning_tokens)
            await self._keep(turn, response, _encoder.encode(response))
            kind = "response.completed" if response.status == "completed" else "response.incomplete"
            yield events.event(kind, response=response)
        except Exception as exc:  # noqa: BLE001 - the response has started: reported as events
            error = as_openai_error(exc)
            code = "server_error" if error.status >= 500 else "invalid_request"
            yield events.event("error", code=code, message=error.message, param=error.param)
            failed = self._response(turn, gen, assembler.items, last, error=ResponseError(code, error.message))
            yield events.event("response.failed", response=failed)

    async def input_tokens(self, body: bytes) -> Response:
        turn = await self._open(body)
        with _responses_params():
            prompt_ids = self.chat._truncate(turn.chat, self.chat._render_chat(turn.chat))
        return json_response(InputTokensResponse(len(prompt_ids)))

    async def retrieve(self, response_id: str) -> Response:
        stored = await self.store.get(response_id)
        if stored is None:
            raise NotFoundError(f"Response with id '{response_id}' not found.", "response_id")
        return Response(stored.response, media_type="application/json")

    async def input_items(self, response_id: str, limit: int, order: str, after: str | None) -> Response:
        """A stored response's own input items, a page of ``limit`` in ``order`` (OpenAI's
        default: newest first) after the item ``after``."""
        if not 1 <= limit <= 100:
            raise BadRequestError(f"limit must be in [1, 100], got {limit}.", "limit")
        if order not in ("asc", "desc"):
            raise BadRequestError(f"order must be asc or desc, got {order!r}.", "order")
        stored = await self.store.get(response_id)
        if stored is None:
            raise NotFoundError(f"Response with id '{response_id}' not found.", "response_id")
        items = msgspec.json.decode(stored.input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise BadRequestError(f"after: no input item {after!r} in response '{response_id}'.", "after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return json_response(InputItemList(
            page, page[0]["id"] if page else None, page[-1]["id"] if page else None, len(items) > limit,
        ))

    async def delete(self, response_id: str) -> Response:
        if not await self.store.delete(response_id):
            raise NotFoundError(f"Response with id '{response_id}' not found.", "response_id")
        return json_response(DeletedResponse(response_id))

    # ------------------------------------------------------------------ output

    def _response(
        self,
        turn: Turn,
        gen: ChatGeneration,
        items: list[OutputItem],
        out: RequestOutput | None,
        reasoning_tokens: int | None = None,
        error: ResponseError | None = None,
    ) -> ResponseObject:
        """The response object: in progress (``out`` None), failed (``error``), else
        completed, or incomplete when the output was cut by max_output_tokens.
        ``reasoning_tokens``: None where they cannot be counted (a ``</think>`` of several
        tokens, see OpenAIServingChat.think_end_token), reported as 0."""
        req = turn.req
        usage = incomplete = None
        if error is not None:
            status = "failed"
        elif out is None:
            status = "in_progress"
        else:
            status = "incomplete" if out.finish_reason == "length" else "completed"
            if status == "incomplete":
                incomplete = IncompleteDetails("max_output_tokens")
        if out is not None:
            prompt = gen.choices[0].request.num_prompt_tokens
            usage = ResponseUsage(
                input_tokens=prompt,
                output_tokens=out.num_output_tokens,
                total_tokens=prompt + out.num_output_tokens,
                input_tokens_details=InputTokensDetails(out.num_cached_tokens),
                output_tokens_details=OutputTokensDetails(reasoning_tokens or 0),
            )
        return ResponseObject(
            id=turn.response_id,
            created_at=turn.created_at,
            completed_at=now() if status in ("completed", "incomplete") else None,
            model=self.chat.response_model(req.model),
            status=status,
            output=items,
            instructions=req.instructions,
            metadata=req.metadata or {},
            tools=turn.tools,
            tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
            parallel_tool_calls=req.parallel_tool_calls is not False,
            temperature=req.temperature,
            top_p=req.top_p,
            max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id,
            reasoning=req.reasoning,
            text=req.text if req.text is not None else TextConfig(format=TextFormat(type="text")),
            store=req.stored,
            usage=usage,
            incomplete_details=incomplete,
            error=error,
        )

    async def _keep(self, turn: Turn, response: ResponseObject, body: bytes) -> None:
        """Store a finished response with the conversation that continues from it."""
        if not turn.req.stored:
            return
        items = with_ids(turn.items)
        conversation = [*turn.history, *items, *response.output]
        await self.store.put(turn.response_id, body, _encoder.encode(items), _encoder.encode(conversation))


@dataclass
class Turn:
    """One Responses request on its way: the request, the conversation before it and its
    own input items, its function tools, and the chat request they make."""

    req: ResponsesRequest
    history: list[InputItem]
    items: list[InputItem]
    tools: list[FunctionTool]
    chat: ChatCompletionRequest
    response_id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=now)

    @property
    def engine_id(self) -> str:
        return self.response_id.replace("_", "-", 1)


_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]+)`")
_AT_PATH = re.compile(r" - at `\$\.?([^`]*)`")


def _decode(body: bytes) -> ResponsesRequest:
    """The request, or a 400 that names the field it is about (an unknown one included)."""
    try:
        return decode_request(body, ResponsesRequest)
    except BadRequestError as exc:
        unknown, at = _UNKNOWN_FIELD.search(exc.message), _AT_PATH.search(exc.message)
        path = [at.group(1) if at is not None else "", unknown.group(1) if unknown is not None else ""]
        exc.param = ".".join(p for p in path if p) or None
        raise


@contextlib.contextmanager
def _responses_params():
    """A 400 from the chat machinery names the field as the Responses request calls it."""
    try:
        yield
    except OpenAIError as exc:
        if exc.param in _PARAM_NAMES:
            exc.param = _PARAM_NAMES[exc.param]
        raise


# ------------------------------------------------------------------ conversion


def chat_messages(instructions: str | None, history: list[InputItem], items: list[InputItem]) -> list[ChatMessage]:
    """The conversation as chat messages: instructions first (they are not carried over
    from earlier responses, as OpenAI's), then every item in order. Function calls join
    the assistant message before them (one assistant turn that says something and calls
    tools); a function's output must answer a call made earlier in the conversation. A
    reasoning item's text is the ``reasoning_content`` of the assistant turn after it
    (templates that show past reasoning write it back); one with nothing readable in it
    (encrypted, summaries only) is dropped."""
    messages = [ChatMessage("system", instructions)] if instructions else []
    calls: set[str] = set()
    reasoning: list[str] = []  # waiting for the assistant turn it belongs to

    def assistant_turn(message: ChatMessage) -> ChatMessage:
        if reasoning and message.reasoning_content is None:
            message.reasoning_content = "".join(reasoning)
        reasoning.clear()
        return message

    for i, item in enumerate([*history, *items]):
        where = f"input[{i - len(history)}]"
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            message = ChatMessage(role, content_text(item.content))
            messages.append(assistant_turn(message) if role == "assistant" else message)
            if role != "assistant":
                reasoning.clear()
        elif isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
            call = ToolCall(id=item.call_id, function=FunctionCall(item.name, item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or ()), call]
                assistant_turn(last)
            else:
                messages.append(assistant_turn(ChatMessage("assistant", None, tool_calls=[call])))
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise BadRequestError(
                    f"{where}: no function_call with call_id {item.call_id!r} precedes this function_call_output.",
                    f"{where}.call_id",
                )
            messages.append(ChatMessage("tool", content_text(item.output), tool_call_id=item.call_id))
            reasoning.clear()
        else:
            assert isinstance(item, ReasoningItem)
            reasoning += [part.text for part in item.content or ()]
    return messages


def _check_function_tool(tool: FunctionTool, i: int) -> None:
    """A function tool the templates and the forced-call grammar can use: a name, and
    parameters that are an object schema."""
    if not tool.name:
        raise BadRequestError(f"tools[{i}].name must not be empty.", f"tools[{i}].name")
    schema = tool.parameters
    if schema is None:
        return
    where = f"tools[{i}].parameters"
    if schema.get("type", "object") != "object":
        raise BadRequestError(f"{where} must be an object schema (type \"object\"), got type {schema['type']!r}.",
                              where)
    if not isinstance(schema.get("properties", {}), dict):
        raise BadRequestError(f"{where}.properties must be an object mapping names to schemas.",
                              f"{where}.properties")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise BadRequestError(f"{where}.required must be a list of property names.", f"{where}.required")


def _chat_tool(tool: FunctionTool) -> ToolDefinition:
    return ToolDefinition(function=FunctionDefinition(
        name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict,
    ))


def _chat_tool_choice(choice: str | dict[str, Any] | None, names: set[str]) -> str | NamedToolChoice | None:
    """auto / none / required, or ``{type: "function", name}``. "auto" without function
    tools (every tool was a kind this server leaves out) is no tool calling at all."""
    if choice is None or (choice == "auto" and not names):
        return None
    if isinstance(choice, str):
        return choice  # chat says which strings it knows
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return NamedToolChoice(function=NamedFunction(choice["name"]))
    raise BadRequestError(
        f"tool_choice must be auto, none, required or {{\"type\": \"function\", \"name\": ...}}, got {choice!r} "
        "(this server runs only function tools).",
        "tool_choice",
    )


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    if text is not None and text.verbosity is not None:
        logger.debug("ignoring text.verbosity: for OpenAI's models")
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema":
        if fmt.schema is None:
            raise BadRequestError("text.format json_schema needs a schema.", "text.format.schema")
        schema = JsonSchemaFormat(name=fmt.name or "response", schema=fmt.schema, description=fmt.description,
                                  strict=fmt.strict)
        return ResponseFormat("json_schema", schema)
    if fmt.type == "json_object":
        return ResponseFormat("json_object")
    raise BadRequestError(f"text.format.type must be text, json_object or json_schema, got {fmt.type!r}.",
                          "text.format.type")


# ------------------------------------------------------------------ output items and events


class EventSequence:
    """Server-sent events as OpenAI writes them: an ``event:`` line with the type, the
    data's ``sequence_number`` rising by one from 0."""

    def __init__(self) -> None:
        self.next = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.next, **fields}
        self.next += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encoder.encode(data) + b"\n\n"


class OutputAssembler:
    """Output deltas in, output items and their stream events out. An item opens when
    its first text arrives and is done when another begins or the output ends; the
    answer's message opens only at text that is not whitespace (the whitespace around
    tool calls is no answer, as chat's parsed output has it)."""

    def __init__(self, events: EventSequence) -> None:
        self.events = events
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None
        self.texts: list[str] = []  # the open item's text (or arguments) so far
        self.blank = ""  # whitespace held back before an answer
        self.calls = 0

    def feed(self, delta: OutputDelta) -> list[bytes]:
        out: list[bytes] = []
        if delta.reasoning:
            if not isinstance(self.open, OutputReasoning):
                out += self._close()
                out += self._start(OutputReasoning(id=new_id("rs"), content=[]), ReasoningText(text=""))
            out.append(self._event("response.reasoning_text.delta", content_index=0, delta=delta.reasoning))
            self.texts.append(delta.reasoning)
        if delta.content:
            text = self.blank + delta.content
            if isinstance(self.open, OutputMessage):
                self.blank = ""
                out += self._text(text)
            elif text.strip():
                self.blank = ""
                out += self._close()
                out += self._start(OutputMessage(id=new_id("msg"), content=[]), OutputText(text=""))
                out += self._text(text)
            else:
                self.blank = text
        for part in delta.tool_calls:
            function = part.function
            if part.index == self.calls:
                assert part.id is not None and function is not None and function.name is not None
                out += self._close()
                self.calls += 1
                call = OutputFunctionCall(id=new_id("fc"), call_id=part.id, name=function.name, arguments="")
                out += self._start(call, None)
            if function is not None and function.arguments:
                out.append(self._event("response.function_call_arguments.delta", delta=function.arguments))
                self.texts.append(function.arguments)
        return out

    def finish(self, cut: bool) -> list[bytes]:
        """Close the last item (incomplete when the output was ``cut``); whitespace held
        back is the answer when nothing else was said."""
        out: list[bytes] = []
        if self.blank and not self.items and self.open is None:
            out += self._start(OutputMessage(id=new_id("msg"), content=[]), OutputText(text=""))
            out += self._text(self.blank)
        return out + self._close("incomplete" if cut else "completed")

    def _event(self, kind: str, **fields: Any) -> bytes:
        assert self.open is not None
        return self.events.event(kind, item_id=self.open.id, output_index=len(self.items) - 1, **fields)

    def _text(self, text: str) -> list[bytes]:
        self.texts.append(text)
        return [self._event("response.output_text.delta", content_index=0, delta=text, logprobs=[])]

    def _start(self, item: OutputItem, part: Any) -> list[bytes]:
        self.items.append(item)
        self.open, self.texts = item, []
        out = [self.events.event("response.output_item.added", output_index=len(self.items) - 1, item=item)]
        if part is not None:
            out.append(self._event("response.content_part.added", content_index=0, part=part))
        return out

    def _close(self, status: str = "completed") -> list[bytes]:
        item = self.open
        if item is None:
            return []
        text = "".join(self.texts)
        out = []
        if isinstance(item, OutputReasoning):
            part = ReasoningText(text=text)
            out.append(self._event("response.reasoning_text.done", content_index=0, text=text))
            out.append(self._event("response.content_part.done", content_index=0, part=part))
            item.content = [part]
        elif isinstance(item, OutputMessage):
            part = OutputText(text=text)
            out.append(self._event("response.output_text.done", content_index=0, text=text, logprobs=[]))
            out.append(self._event("response.content_part.done", content_index=0, part=part))
            item.content = [part]
        else:
            item.arguments = text
            out.append(self._event("response.function_call_arguments.done", name=item.name, arguments=text))
        item.status = status
        out.append(self.events.event("response.output_item.done", output_index=len(self.items) - 1, item=item))
        self.open, self.texts = None, []
        return out


# ------------------------------------------------------------------ routes


def responses_routes(
    chat: OpenAIServingChat,
    store: ResponsesStore,
    openai_route: Callable[[Endpoint], Endpoint],
    admit_for: Callable[[Request], Admit],
    check_awake: Callable[[], None],
    guard: Callable[[Request, Awaitable[Response]], Awaitable[Response]],
) -> list[Route]:
    """POST /v1/responses (and /responses), POST /v1/responses/input_tokens, GET and
    DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items. ``guard`` runs a generation, cancelling it when the client
    leaves (app/server.py's)."""
    serving = OpenAIServingResponses(chat, store)

    async def create(request: Request) -> Response:
        check_awake()
        body = await request.body()
        return await guard(request, serving.create(body, admit_for(request)))

    async def input_tokens(request: Request) -> Response:
        return await serving.input_tokens(await request.body())

    async def retrieve(request: Request) -> Response:
        return await serving.retrieve(request.path_params["response_id"])

    async def delete(request: Request) -> Response:
        return await serving.delete(request.path_params["response_id"])

    async def input_items(request: Request) -> Response:
        query = request.query_params
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            raise BadRequestError(f"limit must be an integer, got {query['limit']!r}.", "limit") from None
        return await serving.input_items(
            request.path_params["response_id"], limit, query.get("order", "desc"), query.get("after"),
        )

    routes = []
    for prefix in ("/v1", ""):
        routes += [
            Route(f"{prefix}/responses", openai_route(create), methods=["POST"]),
            Route(f"{prefix}/responses/input_tokens", openai_route(input_tokens), methods=["POST"]),
            Route(f"{prefix}/responses/{{response_id}}", openai_route(retrieve), methods=["GET"]),
            Route(f"{prefix}/responses/{{response_id}}", openai_route(delete), methods=["DELETE"]),
            Route(f"{prefix}/responses/{{response_id}}/input_items", openai_route(input_items), methods=["GET"]),
        ]
    return routes
