"""The OpenAI endpoints: /v1/completions, /v1/chat/completions and /v1/models,
plus vLLM's /tokenize and /detokenize.

A handler decodes and checks the request, builds the prompts' token ids,
asks the InputProcessor for one validated EngineCoreRequest per choice (n
per prompt, app/choices.py), then either collects the whole outputs or
streams them as server-sent events, each chunk carrying its choice's index.
Everything that is wrong with a request is reported before generation
starts, as an HTTP error; a failure during a stream becomes an ``error``
event (which OpenAI's clients raise as APIError) that ends the stream
without [DONE]. Logprobs take OpenAI's shapes in app/logprobs.py.

The engine is an ``EngineClient`` (``AsyncLLM``): ``generate(request)`` is an
async generator of RequestOutput deltas that aborts the request when it is
closed early. A client that hangs up is noticed by one watcher,
``until_disconnect``, for streamed and whole responses alike.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app.choices import Choice, collect_all, merged
from app.errors import (
    BadRequestError,
    InternalServerError,
    NotFoundError,
    OpenAIError,
    ServiceUnavailableError,
    StreamTimeoutError,
)
from app.input_processor import InputProcessor
from app.logprobs import (
    Logprobs,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
)
from app.output_processor import RequestOutput
from app.protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    now,
    random_id,
)
from app.tool_calls import (
    forced_call_constraint,
    parse_forced,
    parse_hermes,
    tool_call_stream,
)
from core.protocol import (
    EngineCoreRequest,
    EngineDeadError,
    EngineUnavailableError,
    SamplingParams,
    StructuredOutputsParams,
)
from core.utilities import Call

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("ringllm.serving")
T = TypeVar("T")
R = TypeVar("R")
Admit = Callable[[int], None]  # takes n engine requests from admission, or raises a 503

_encoder = msgspec.json.Encoder()
DONE_EVENT = b"data: [DONE]\n\n"


class EngineClient(Protocol):
    """What the HTTP layer needs from the engine (implemented by ``AsyncLLM``)."""

    input_processor: InputProcessor
    chat_template: str | None
    data_parallel_size: int

    @property
    def is_dead(self) -> bool: ...

    def engines_alive(self) -> list[bool]: ...

    def generate(self, request: EngineCoreRequest) -> AsyncGenerator[RequestOutput, None]: ...

    async def call(self, call: Call[R]) -> R: ...

    async def call_each(self, call: Call[R]) -> list[R | None]: ...


def json_response(body: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(body), status_code=status, media_type="application/json")


def sse_event(body: Any) -> bytes:
    return b"data: " + _encoder.encode(body) + b"\n\n"


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

    def __init__(self, events: AsyncGenerator[bytes, None], stall_timeout: float | None = None) -> None:
        """``stall_timeout``: seconds the stream may go without an event before it is
        ended with an error event (and its requests aborted); None waits for ever."""
        # No Response.__init__: it would render a body and announce its length.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events
        self.stall_timeout = stall_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            await until_disconnect(receive, self._pump(send))
        finally:
            await self.events.aclose()

    async def _pump(self, send: Send) -> None:
        if self.stall_timeout is None:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
        else:
            while True:
                try:
                    event = await asyncio.wait_for(self.events.__anext__(), self.stall_timeout)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:  # the generator was cancelled: its requests are aborted
                    error = StreamTimeoutError(
                        f"No output for {self.stall_timeout:g} s (--stream-stall-timeout); the request was aborted."
                    )
                    event = sse_event(error.to_response())
                    await send({"type": "http.response.body", "body": event, "more_body": True})
                    break
                await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _decode(body: bytes, request_type: type) -> Any:
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        raise BadRequestError(f"Invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequestError(f"The request body is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:  # msgspec raises it for invalid UTF-8 inside a string
        raise BadRequestError(f"The request body is not valid UTF-8: {exc}") from None
    except RecursionError:  # JSON nested thousands deep
        raise BadRequestError("The request body is nested too deeply.") from None


class OpenAIServing:
    """Implements the OpenAI routes on top of an AsyncLLM-like engine."""

    def __init__(
        self,
        engine: EngineClient,
        served_model_name: str,
        max_model_len: int,
        chat_template: str | None = None,
        model_aliases: Sequence[str] = (),
        enable_auto_tool_choice: bool = False,
        tool_call_parser: str | None = None,
        stream_stall_timeout: float | None = None,
    ) -> None:
        self.engine = engine
        self.stream_stall_timeout = stream_stall_timeout
        # tool_choice "auto" needs both (--enable-auto-tool-choice --tool-call-parser), as in vLLM.
        self.tool_call_parser = tool_call_parser if enable_auto_tool_choice else None
        self.served_model_name = served_model_name
        # Other names requests may use (not listed by /v1/models, which would
        # show one model twice); responses always carry the served name.
        self.accepted_model_names = frozenset((served_model_name, *model_aliases))
        self.max_model_len = max_model_len
        # The server-wide --chat-template; a request's own chat_template wins.
        self.chat_template = chat_template if chat_template is not None else engine.chat_template
        self.created = now()
        self.token_texts = TokenTexts(engine.input_processor.tokenizer)

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
        params: SamplingParams,
        prompt_embeds: torch.Tensor | None = None,
    ) -> EngineCoreRequest:
        rank, engines = req.data_parallel_rank, self.engine.data_parallel_size
        if rank is not None and not 0 <= rank < engines:
            raise BadRequestError(
                f"data_parallel_rank must be in [0, {engines - 1}] (the server runs {engines} engines), got {rank}.",
                "data_parallel_rank",
            )
        try:
            return self.input_processor.process(
                request_id, prompt_ids, params, req.priority, req.cache_salt, prompt_embeds, rank
            )
        except ValueError as exc:
            raise BadRequestError(str(exc), getattr(exc, "param", None)) from None

    def _bad_words(self, req: CompletionRequest | ChatCompletionRequest) -> list[list[int]]:
        try:
            return self.input_processor.bad_words_token_ids(req.bad_words or [])
        except ValueError as exc:
            raise BadRequestError(str(exc), "bad_words") from None

    def _truncate(self, req: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int]) -> list[int]:
        """The last truncate_prompt_tokens tokens of the prompt (vLLM's left truncation)."""
        keep = req.truncate_prompt_tokens
        return prompt_ids if keep is None or len(prompt_ids) <= keep else prompt_ids[-keep:]

    def _choices(
        self,
        request_id: str,
        req: CompletionRequest | ChatCompletionRequest,
        prompts: list[tuple[list[int], torch.Tensor | None, str]],
        max_tokens: int | None,
        structured: StructuredOutputsParams | None = None,
    ) -> list[Choice]:
        """n engine requests per prompt; choice ``p * n + i`` is sample i of prompt p.
        Under a grammar the template's turn-ending stop strings do not apply: the
        grammar says where the output ends."""
        bad_words = self._bad_words(req)
        choices = []
        for p, (prompt_ids, embeds, text) in enumerate(prompts):
            num_prompt = len(prompt_ids) if embeds is None else int(embeds.shape[0])
            tokens = max_tokens
            if tokens is None:
                tokens = self.input_processor.default_max_tokens(num_prompt)
                if isinstance(req, CompletionRequest):  # OpenAI's default, shortened to what fits
                    tokens = max(min(COMPLETION_DEFAULT_MAX_TOKENS, tokens), 1)
            for i in range(req.n):
                index = p * req.n + i
                params = req.sampling_params(
                    tokens, req.num_logprobs, req.num_prompt_logprobs, bad_words, i, structured
                )
                if isinstance(req, ChatCompletionRequest) and structured is None and self.turn_stop(req):
                    params.stop = params.stop + [s for s in self.turn_stop(req) if s not in params.stop]
                engine_request = self._engine_request(f"{request_id}-{index}", prompt_ids, req, params, embeds)
                choices.append(Choice(index, p, engine_request, text))
        return choices

    # ------------------------------------------------------------- completions

    def _completion_prompts(self, req: CompletionRequest) -> list[tuple[list[int], torch.Tensor | None, str]]:
        """(token ids, embeddings, text for echo) of each prompt."""
        tokenizer = self.input_processor.tokenizer
        try:
            if (embeds_list := req.prompt_embeds_list()) is not None:
                return [([], self.input_processor.load_prompt_embeds(e), "") for e in embeds_list]
        except ValueError as exc:
            raise BadRequestError(str(exc), "prompt_embeds") from None
        prompts = []
        for prompt in req.prompts():
            try:
                ids = self.input_processor.tokenize_prompt(prompt, req.add_special_tokens)
            except ValueError as exc:
                raise BadRequestError(str(exc), "prompt") from None
            truncated = self._truncate(req, ids)
            text = ""
            if req.echo:
                text = prompt if isinstance(prompt, str) and truncated is ids else tokenizer.decode(
                    truncated, skip_special_tokens=req.skip_special_tokens
                )
            prompts.append((truncated, None, text))
        return prompts

    async def create_completion(self, body: bytes, admit: Admit | None = None) -> Response:
        req: CompletionRequest = _decode(body, CompletionRequest)
        self._check_model(req.model)
        req.check_supported()
        self._check_alive()
        engine_id = random_id("cmpl")  # unique, whatever the client calls its request
        request_id = req.response_id("cmpl", engine_id)
        echo_only = req.echo and req.max_tokens == 0  # the prompt alone: one token is run, and dropped
        structured = req.structured_params()
        choices = self._choices(
            engine_id, req, self._completion_prompts(req), 1 if echo_only else req.max_tokens, structured
        )
        if admit is not None:
            admit(len(choices))
        param = req.structured_param if structured is not None else None
        if req.stream:
            source = await self._primed(choices, param) if structured is not None else None
            return EventStreamResponse(
                self._stream_completion(request_id, req, choices, echo_only, source, param), self.stream_stall_timeout
            )
        outputs = await self._collect_all(choices, param)
        response_choices = []
        for choice, out in zip(choices, outputs):
            text, logprobs = self._completion_delta(req, choice, out, echo_only)
            response_choices.append(
                CompletionChoice(
                    index=choice.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason="length" if echo_only else out.finish_reason,
                    stop_reason=None if echo_only else out.stop_reason,
                    prompt_logprobs=self._prompt_logprobs(req, out),
                )
            )
        return json_response(
            CompletionResponse(
                id=request_id,
                created=now(),
                model=self.served_model_name,
                choices=response_choices,
                usage=_usage(choices, outputs, echo_only),
            )
        )

    def _completion_delta(
        self, req: CompletionRequest, choice: Choice, out: RequestOutput, echo_only: bool
    ) -> tuple[str, CompletionLogprobs | None]:
        """Text and logprobs of a delta (or of a whole output), the echoed prompt
        in front of the first one."""
        text = "" if echo_only else out.text
        entries = Logprobs([], [], []) if echo_only or out.logprobs is None else out.logprobs
        first_prompt_token = None
        if req.echo and not choice.started:
            text = choice.prompt_text + text
            prompt_ids = choice.request.prompt_token_ids
            if req.logprobs is not None and prompt_ids:
                first_prompt_token = prompt_ids[0]
                prompt_entries = out.prompt_logprobs or Logprobs([], [], [])
                entries = Logprobs(
                    prompt_entries.token_ids + entries.token_ids,
                    prompt_entries.logprobs + entries.logprobs,
                    prompt_entries.ranks + entries.ranks,
                )
        choice.started = True
        if req.logprobs is None:
            return text, None
        logprobs, choice.text_offset = completion_logprobs(
            self.token_texts, entries, req.logprobs, choice.text_offset, first_prompt_token,
            req.return_tokens_as_token_ids,
        )
        return text, logprobs

    def _prompt_logprobs(self, req: CompletionRequest | ChatCompletionRequest, out: RequestOutput) -> Any:
        if req.prompt_logprobs is None:
            return None
        return prompt_logprobs(self.token_texts, out.prompt_logprobs)

    def _stream_completion(
        self,
        request_id: str,
        req: CompletionRequest,
        choices: list[Choice],
        echo_only: bool,
        source: AsyncGenerator[tuple[Choice, RequestOutput], None] | None = None,
        param: str | None = None,
    ) -> AsyncGenerator[bytes, None]:
        created = now()

        def chunk(choice_objects: list[CompletionChoice], usage: UsageInfo | None = None) -> bytes:
            return sse_event(
                CompletionResponse(
                    id=request_id, created=created, model=self.served_model_name,
                    choices=choice_objects, usage=usage,
                )
            )

        def delta(choice: Choice, out: RequestOutput) -> CompletionChoice | None:
            first = not choice.started
            text, logprobs = self._completion_delta(req, choice, out, echo_only)
            prompt_lps = self._prompt_logprobs(req, out) if first else None
            if not (text or out.finished or prompt_lps or (logprobs is not None and logprobs.tokens)):
                return None
            finish_reason = ("length" if echo_only else out.finish_reason) if out.finished else None
            return CompletionChoice(
                choice.index, text, logprobs, finish_reason, None if echo_only else out.stop_reason, prompt_lps
            )

        return self._stream_events(req, choices, chunk, delta, echo_only=echo_only, source=source, param=param)

    # -------------------------------------------------------- chat completions

    def turn_stop(self, req: ChatCompletionRequest) -> Sequence[str]:
        """Stop strings that end a turn of the model's own template; like an
        end-of-turn token, they do not apply under ignore_eos."""
        if req.chat_template is None and self.chat_template is None and not req.ignore_eos:
            return self.input_processor.chat_stop
        return ()

    async def create_chat_completion(self, body: bytes, admit: Admit | None = None) -> Response:
        req: ChatCompletionRequest = _decode(body, ChatCompletionRequest)
        self._check_model(req.model)
        req.check_supported()
        self._check_alive()
        engine_id = random_id("chatcmpl")  # unique, whatever the client calls its request
        request_id = req.response_id("chatcmpl", engine_id)
        if req.tools and req.effective_tool_choice == "auto" and self.tool_call_parser is None:
            raise BadRequestError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set.',
                "tool_choice",
            )
        prompt_ids = self._truncate(req, self._render_chat(req))
        if req.forced_tool_call:
            structured, param = forced_call_constraint(req), "tools"
        else:
            structured = req.structured_params()
            param = req.structured_param if structured is not None else None
        choices = self._choices(engine_id, req, [(prompt_ids, None, "")], req.requested_max_tokens, structured)
        if admit is not None:
            admit(len(choices))
        if req.stream:
            source = await self._primed(choices, param) if structured is not None else None
            return EventStreamResponse(self._stream_chat(request_id, req, choices, source, param), self.stream_stall_timeout)
        outputs = await self._collect_all(choices, param)
        response_choices = [
            ChatChoice(
                index=choice.index,
                message=message,
                logprobs=self._chat_logprobs(req, out),
                finish_reason=finish_reason,
                stop_reason=out.stop_reason,
            )
            for choice, out in zip(choices, outputs)
            for message, finish_reason in [self._chat_message(req, out)]
        ]
        return json_response(
            ChatCompletionResponse(
                id=request_id,
                created=now(),
                model=self.served_model_name,
                choices=response_choices,
                usage=_usage(choices, outputs),
                prompt_logprobs=self._prompt_logprobs(req, outputs[0]),
            )
        )

    def _chat_message(self, req: ChatCompletionRequest, out: RequestOutput) -> tuple[AssistantMessage, str | None]:
        """The assistant's message, with the tool calls found in (or forced on) its text."""
        calls = []
        content: str | None = out.text
        if req.forced_tool_call:
            calls = parse_forced(req, out.text)
            content = None if calls else out.text
        elif req.tools and req.effective_tool_choice == "auto" and self.tool_call_parser == "hermes":
            content, calls = parse_hermes(out.text)
        finish_reason = out.finish_reason
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return AssistantMessage(content=content, tool_calls=calls), finish_reason

    def _render_chat(self, req: ChatCompletionRequest | TokenizeRequest) -> list[int]:
        assert req.messages is not None
        messages = [m.to_template_dict() for m in req.messages]
        template = req.chat_template if req.chat_template is not None else self.chat_template
        add_special = bool(req.add_special_tokens)
        kwargs = dict(req.chat_template_kwargs or {})
        tools = getattr(req, "tools", None)
        if tools and getattr(req, "tool_choice", None) != "none":
            kwargs["tools"] = [t.to_template_dict() for t in tools]
        try:
            return self.input_processor.apply_chat_template(
                messages, template, req.add_generation_prompt, add_special, **kwargs
            )
        except ValueError as exc:
            raise BadRequestError(str(exc), "messages") from None

    def _chat_logprobs(self, req: ChatCompletionRequest, out: RequestOutput) -> ChatLogprobs | None:
        if not req.logprobs or out.logprobs is None:
            return None
        return chat_logprobs(self.token_texts, out.logprobs, req.top_logprobs or 0, req.return_tokens_as_token_ids)

    def _stream_chat(
        self,
        request_id: str,
        req: ChatCompletionRequest,
        choices: list[Choice],
        source: AsyncGenerator[tuple[Choice, RequestOutput], None] | None = None,
        param: str | None = None,
    ) -> AsyncGenerator[bytes, None]:
        created = now()
        tool_streams = {c.index: tool_call_stream(req, self.tool_call_parser) for c in choices}

        def chunk(choice_objects: list[ChatChunkChoice], usage: UsageInfo | None = None) -> bytes:
            return sse_event(
                ChatCompletionChunk(
                    id=request_id, created=created, model=self.served_model_name,
                    choices=choice_objects, usage=usage,
                )
            )

        def delta(choice: Choice, out: RequestOutput) -> ChatChunkChoice | None:
            logprobs = self._chat_logprobs(req, out)
            text, calls, finish_reason = out.text, None, out.finish_reason
            tools = tool_streams[choice.index]
            if tools is not None:
                text, calls = tools.feed(out.text, out.finished)
                if tools.num_calls and finish_reason == "stop":
                    finish_reason = "tool_calls"
            if not (text or calls or out.finished or (logprobs is not None and logprobs.content)):
                return None
            message = DeltaMessage(content=text or None, tool_calls=calls or None)
            return ChatChunkChoice(choice.index, message, logprobs, finish_reason, out.stop_reason)

        openings = [chunk([ChatChunkChoice(c.index, DeltaMessage(role="assistant", content=""))]) for c in choices]
        return self._stream_events(req, choices, chunk, delta, openings, source=source, param=param)

    # ---------------------------------------------------------- tokenization

    def tokenize(self, body: bytes) -> Response:
        req: TokenizeRequest = _decode(body, TokenizeRequest)
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise BadRequestError("Give either prompt or messages.", "prompt")
        if req.messages is not None:
            ids = self._render_chat(req)
        else:
            assert req.prompt is not None
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = self.input_processor.tokenize_prompt(req.prompt, add_special)
        strs = [self.token_texts.text_of(t) for t in ids] if req.return_token_strs else None
        return json_response(TokenizeResponse(len(ids), self.max_model_len, ids, strs))

    def detokenize(self, body: bytes) -> Response:
        req: DetokenizeRequest = _decode(body, DetokenizeRequest)
        self._check_model(req.model)
        vocab = self.input_processor.limits.vocab_size
        for token_id in req.tokens:
            if not 0 <= token_id < vocab:
                raise BadRequestError(f"Token id {token_id} is out of vocabulary (size {vocab}).", "tokens")
        return json_response(DetokenizeResponse(self.input_processor.tokenizer.decode(req.tokens)))

    # ----------------------------------------------------------------- engine

    async def _stream_events(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        choices: list[Choice],
        chunk: Callable[..., bytes],
        delta: Callable[[Choice, RequestOutput], Any],
        openings: Sequence[bytes] = (),
        echo_only: bool = False,
        source: AsyncGenerator[tuple[Choice, RequestOutput], None] | None = None,
        param: str | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """The SSE body of one API request: ``openings``, a chunk per delta of any
        choice that has something to say (``delta``), usage if asked for (in every
        chunk too with ``continuous_usage_stats``), then ``[DONE]``. A failure after
        the response has started becomes an error event in OpenAI's format."""
        continuous = req.include_usage and req.continuous_usage
        try:
            for opening in openings:
                yield opening
            async for choice, out in source if source is not None else merged(self.engine.generate, choices):
                _check_output(out, param)
                choice.last = out
                update = delta(choice, out)
                if update is not None:
                    usage = _choice_usage(choice, out, echo_only) if continuous else None
                    yield chunk([update], usage)
            if req.include_usage:
                yield chunk([], _usage(choices, [c.last for c in choices], echo_only))
            yield DONE_EVENT
        except Exception as exc:  # noqa: BLE001 - reported to the client as an event
            yield sse_event(as_openai_error(exc).to_response())

    async def _collect_all(self, choices: list[Choice], param: str | None = None) -> list[RequestOutput]:
        try:
            outputs = await collect_all(self.engine.generate, choices)
        except Exception as exc:
            raise as_openai_error(exc) from exc
        for out in outputs:
            _check_output(out, param)
        return outputs

    async def _primed(
        self, choices: list[Choice], param: str | None
    ) -> AsyncGenerator[tuple[Choice, RequestOutput], None]:
        """The merged outputs, once the first has arrived: a request the engine refuses
        (an invalid grammar, which only the engine can compile) is then still a 400,
        not an error event after a 200."""
        stream = merged(self.engine.generate, choices)
        try:
            first = await stream.__anext__()
            _check_output(first[1], param)
        except StopAsyncIteration:
            first = None
        except BaseException:
            await stream.aclose()
            raise

        async def chained() -> AsyncGenerator[tuple[Choice, RequestOutput], None]:
            try:
                if first is not None:
                    yield first
                async for item in stream:
                    yield item
            finally:
                await stream.aclose()

        return chained()


def _check_output(out: RequestOutput, param: str | None = None) -> None:
    """An engine error with a message is the request's fault (the engine refused it: a
    grammar that does not compile); without one, the engine's."""
    if out.finish_reason == "error":
        if isinstance(out.stop_reason, str) and out.stop_reason:
            raise BadRequestError(out.stop_reason, param)
        raise InternalServerError("The engine failed while generating this request.")


def _choice_usage(choice: Choice, out: RequestOutput, echo_only: bool = False) -> UsageInfo:
    """Usage so far of one choice (continuous_usage_stats, as vLLM reports it)."""
    completion = 0 if echo_only else out.num_output_tokens
    return UsageInfo.of(choice.request.num_prompt_tokens, completion, out.num_cached_tokens)


def _usage(choices: list[Choice], outputs: Sequence[RequestOutput | None], echo_only: bool = False) -> UsageInfo:
    """Usage of a whole response: each prompt counted once (with its first
    choice's cached tokens), the completion tokens of every choice."""
    prompt = cached = completion = 0
    seen: set[int] = set()
    for choice, out in zip(choices, outputs):
        if choice.prompt_index not in seen:
            seen.add(choice.prompt_index)
            prompt += choice.request.num_prompt_tokens
            cached += out.num_cached_tokens if out is not None else 0
        if out is not None and not echo_only:
            completion += out.num_output_tokens
    return UsageInfo.of(prompt, completion, cached)
