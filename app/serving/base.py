"""What every OpenAI endpoint shares: the engine handle, request decoding, engine requests, outputs.

A handler (app/serving/completions.py, chat.py, tokenize.py) decodes and
checks the request, builds the prompts' token ids, asks the InputProcessor
for one validated EngineCoreRequest per choice (n per prompt,
app/choices.py), then either collects the whole outputs or streams them as
server-sent events (app/serving/sse.py), each chunk carrying its choice's
index. Everything that is wrong with a request is reported before
generation starts, as an HTTP error; a failure during a stream becomes an
``error`` event (which OpenAI's clients raise as APIError) that ends the
stream without [DONE]. Logprobs take OpenAI's shapes in app/logprobs.py.

The engine is an ``EngineClient`` (``AsyncLLM``): ``generate(request)`` is an
async generator of RequestOutput deltas that aborts the request when it is
closed early.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec
from starlette.responses import Response

from app.choices import Choice, collect_all, merged
from app.errors import (
    BadRequestError,
    InternalServerError,
    NotFoundError,
    as_openai_error,
)
from app.input_processor import InputProcessor
from app.logprobs import TokenTexts, prompt_logprobs
from app.lora_adapters import LoRARegistry
from app.output_processor import RequestOutput
from app.parsing.detect import detect_reasoning_parser, detect_tool_call_parser, resolve
from app.protocol.chat import ChatCompletionRequest
from app.protocol.common import ModelCard, ModelList, UsageInfo, now, random_id
from app.protocol.completions import CompletionRequest
from app.protocol.tokenize import TokenizeRequest
from app.serving.sse import DONE_EVENT, EventStreamResponse, sse_event
from core.protocol import EngineCoreRequest, SamplingParams, StructuredOutputsParams
from core.utilities import Call

if TYPE_CHECKING:
    import torch

R = TypeVar("R")
G = TypeVar("G", CompletionRequest, ChatCompletionRequest)
Admit = Callable[[int], None]  # takes n engine requests from admission, or raises a 503
Prompt = tuple[list[int], "torch.Tensor | None", str]  # token ids, embeddings, text for echo

_encoder = msgspec.json.Encoder()


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


def decode_request(body: bytes, request_type: type) -> Any:
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
    """The plumbing of the OpenAI routes on top of an AsyncLLM-like engine; one
    subclass per endpoint family."""

    def __init__(
        self,
        engine: EngineClient,
        served_model_name: str,
        max_model_len: int,
        chat_template: str | None = None,
        model_aliases: Sequence[str] = (),
        enable_auto_tool_choice: bool = False,
        tool_call_parser: str | None = "auto",
        stream_stall_timeout: float | None = None,
        loras: LoRARegistry | None = None,
        reasoning_parser: str | None = "auto",
    ) -> None:
        self.engine = engine
        # The LoRA adapters requests may name as their model (app/lora_adapters.py).
        self.loras = loras if loras is not None else LoRARegistry(None, served_model_name)
        self.stream_stall_timeout = stream_stall_timeout
        # --tool-call-parser / --reasoning-parser as given ("auto": read from the chat template in use;
        # enable_auto_tool_choice, vLLM's switch, is accepted and changes nothing: tools always work).
        self.tool_call_parser_setting = tool_call_parser
        self.reasoning_parser_setting = reasoning_parser
        self.served_model_name = served_model_name
        # Other names requests may use (not listed by /v1/models, which would
        # show one model twice); responses always carry the served name.
        self.accepted_model_names = frozenset((served_model_name, *model_aliases))
        self.max_model_len = max_model_len
        # The server-wide --chat-template; a request's own chat_template wins.
        self.chat_template = chat_template if chat_template is not None else engine.chat_template
        self.tool_call_parser, self.reasoning_parser = self.parsers_for(None)
        self.created = now()
        self.token_texts = TokenTexts(engine.input_processor.tokenizer)

    @property
    def input_processor(self) -> InputProcessor:
        return self.engine.input_processor

    def parsers_for(self, request_template: str | None) -> tuple[str | None, str | None]:
        """(tool-call parser, reasoning parser) of a request: as set, or, where "auto", what the
        template in use shows (a request's own chat_template, else the server's or the model's)."""
        template = request_template if request_template is not None else self.chat_template
        if template is None:
            template = getattr(self.input_processor.tokenizer, "chat_template", None)
        return (
            resolve(self.tool_call_parser_setting, detect_tool_call_parser(template)),
            resolve(self.reasoning_parser_setting, detect_reasoning_parser(template)),
        )

    # ------------------------------------------------------------------ models

    def list_models(self) -> Response:
        """The base model, then each LoRA adapter (its ``parent`` the base model, its ``root`` its directory)."""
        card = ModelCard(id=self.served_model_name, created=self.created, max_model_len=self.max_model_len)
        return json_response(ModelList(data=[card, *self.loras.cards(self.created, self.max_model_len)]))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_model_names and self.loras.get(model) is None:
            raise NotFoundError(f"The model `{model}` does not exist.", "model")

    def response_model(self, model: str | None) -> str:
        """The model a response names: the adapter asked for, else the served model's name."""
        return model if model is not None and self.loras.get(model) is not None else self.served_model_name

    def _check_alive(self) -> None:
        if self.engine.is_dead:
            raise InternalServerError("The engine is dead; this server can no longer generate.")

    def _open_request(self, body: bytes, request_type: type[G], prefix: str) -> tuple[G, str, str]:
        """A generation request, decoded and checked (an HTTP error if it cannot be served),
        with the engine's id for it (unique, whatever the client calls its request) and
        the id its response carries."""
        req = decode_request(body, request_type)
        self._check_model(req.model)
        req.check_supported()
        self._check_alive()
        engine_id = random_id(prefix)
        return req, engine_id, req.response_id(prefix, engine_id)

    # ------------------------------------------------------- engine requests

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """max_tokens when the request gives none: as many as fit (completions say otherwise)."""
        return self.input_processor.default_max_tokens(num_prompt_tokens)

    def extra_stop(
        self, req: CompletionRequest | ChatCompletionRequest, structured: StructuredOutputsParams | None
    ) -> Sequence[str]:
        """Stop strings the server adds to the request's own (chat says which)."""
        return ()

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
                request_id, prompt_ids, params, req.priority, req.cache_salt, prompt_embeds, rank,
                lora_request=self.loras.get(req.model),
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
        """n engine requests per prompt; choice ``p * n + i`` is sample i of prompt p."""
        bad_words = self._bad_words(req)
        stops = self.extra_stop(req, structured)
        choices = []
        for p, (prompt_ids, embeds, text) in enumerate(prompts):
            num_prompt = len(prompt_ids) if embeds is None else int(embeds.shape[0])
            tokens = max_tokens if max_tokens is not None else self.default_max_tokens(num_prompt)
            for i in range(req.n):
                index = p * req.n + i
                params = req.sampling_params(
                    tokens, req.num_logprobs, req.num_prompt_logprobs, bad_words, i, structured
                )
                if stops:
                    params.stop = params.stop + [s for s in stops if s not in params.stop]
                engine_request = self._engine_request(f"{request_id}-{index}", prompt_ids, req, params, embeds)
                choices.append(Choice(index, p, engine_request, text))
        return choices

    def _render_chat(self, req: ChatCompletionRequest | TokenizeRequest) -> list[int]:
        assert req.messages is not None
        messages = [m.to_template_dict() for m in req.messages]
        template = req.chat_template if req.chat_template is not None else self.chat_template
        add_special = bool(req.add_special_tokens)
        kwargs = req.template_kwargs()
        if "enable_thinking" not in kwargs and self.parsers_for(req.chat_template)[1] is not None:
            # A thinking model thinks unless the request says otherwise, as llama-server renders it
            # (llama.cpp's DeepSeek-R1 template closes the block when enable_thinking is unset).
            kwargs["enable_thinking"] = True
        if req.tools:  # shown to the template whenever given (tool_choice "none" too, as OpenAI's)
            kwargs["tools"] = [t.to_template_dict() for t in req.tools]
        try:
            return self.input_processor.apply_chat_template(
                messages, template, req.add_generation_prompt, add_special, **kwargs
            )
        except ValueError as exc:
            raise BadRequestError(str(exc), "messages") from None

    def _prompt_logprobs(self, req: CompletionRequest | ChatCompletionRequest, out: RequestOutput) -> Any:
        if req.prompt_logprobs is None:
            return None
        return prompt_logprobs(self.token_texts, out.prompt_logprobs)

    # ----------------------------------------------------------------- outputs

    async def _stream_response(
        self,
        request_id: str,
        req: CompletionRequest | ChatCompletionRequest,
        choices: list[Choice],
        chunk_type: Callable[..., msgspec.Struct],
        delta: Callable[[Choice, RequestOutput], Any],
        opening: Callable[[Choice], Any] | None = None,
        echo_only: bool = False,
        structured: StructuredOutputsParams | None = None,
        param: str | None = None,
    ) -> EventStreamResponse:
        """A streamed response (chat and completions alike): every chunk a ``chunk_type``
        (``ChatCompletionChunk``, ``CompletionResponse``) with the same id, created and
        model, its choices what ``delta`` makes of each output (``opening`` of each
        choice first, chat's role); see ``_stream_events``. Under a grammar the first
        output is awaited here, so that a grammar the engine refuses is still a 400."""
        source = await self._primed(choices, param) if structured is not None else None
        created, model = now(), self.response_model(req.model)  # once, not per chunk

        def chunk(choice_objects: list[Any], usage: UsageInfo | None = None) -> bytes:
            body = chunk_type(id=request_id, created=created, model=model, choices=choice_objects, usage=usage)
            return sse_event(body)

        openings = [chunk([opening(c)]) for c in choices] if opening is not None else ()
        events = self._stream_events(req, choices, chunk, delta, openings, echo_only, source, param)
        return EventStreamResponse(events, self.stream_stall_timeout)

    async def _stream_events(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        choices: list[Choice],
        chunk: Callable[[list[Any], UsageInfo | None], bytes],
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
                check_output(out, param)
                choice.last = out
                update = delta(choice, out)
                if update is not None:
                    usage = _choice_usage(choice, out, echo_only) if continuous else None
                    yield chunk([update], usage)
            if req.include_usage:
                yield chunk([], usage_of(choices, [c.last for c in choices], echo_only))
            yield DONE_EVENT
        except Exception as exc:  # noqa: BLE001 - reported to the client as an event
            yield sse_event(as_openai_error(exc).to_response())

    async def _collect_all(self, choices: list[Choice], param: str | None = None) -> list[RequestOutput]:
        try:
            outputs = await collect_all(self.engine.generate, choices)
        except Exception as exc:
            raise as_openai_error(exc) from exc
        for out in outputs:
            check_output(out, param)
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
            check_output(first[1], param)
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


def check_output(out: RequestOutput, param: str | None = None) -> None:
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


def usage_of(choices: list[Choice], outputs: Sequence[RequestOutput | None], echo_only: bool = False) -> UsageInfo:
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
