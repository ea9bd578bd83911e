"""/v1/chat/completions: the chat template, tool calls (forced or parsed), reasoning, chat logprobs; whole or streamed.

The tool-call and reasoning parsers are the server's (``--tool-call-parser``,
``--reasoning-parser``, by default read from the chat template, app/parsing/detect.py),
or read from a request's own ``chat_template``. Thinking is on unless the
request turns it off (``chat_template_kwargs.enable_thinking`` or
``reasoning_effort``), which the template does in the prompt; whether the
prompt left the reasoning block open is read from its last tokens.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from app.choices import Choice, merged
from app.logprobs import chat_logprobs
from app.output_processor import RequestOutput
from app.parsing.output import OutputDelta, OutputParser, ParsedOutput
from app.parsing.reasoning import THINK_CLOSE, ReasoningTokens, ThinkStream, thinking_closed
from app.parsing.tool_calls import forced_call_constraint, tool_call_stream
from app.protocol.chat import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaMessage,
)
from app.protocol.common import now
from app.protocol.completions import CompletionRequest
from app.serving.base import (
    Admit,
    OpenAIServing,
    check_output,
    json_response,
    usage_of,
)
from core.protocol import ReasoningParams, StructuredOutputsParams

logger = logging.getLogger("ringllm")


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        logger.info(
            "chat output parsers: tool calls %s, reasoning %s (--tool-call-parser %s, --reasoning-parser %s)",
            self.tool_call_parser or "none", self.reasoning_parser or "none",
            self.tool_call_parser_setting, self.reasoning_parser_setting,
        )

    def turn_stop(self, req: ChatCompletionRequest) -> Sequence[str]:
        """Stop strings that end a turn of the model's own template; like an
        end-of-turn token, they do not apply under ignore_eos."""
        if req.chat_template is None and self.chat_template is None and not req.ignore_eos:
            return self.input_processor.chat_stop
        return ()

    def extra_stop(
        self, req: CompletionRequest | ChatCompletionRequest, structured: StructuredOutputsParams | None
    ) -> Sequence[str]:
        """The template's turn-ending stop strings, except under a grammar (which says
        where the output ends)."""
        if structured is not None or not isinstance(req, ChatCompletionRequest):
            return ()
        return self.turn_stop(req)

    def prepare(self, req: ChatCompletionRequest, engine_id: str, admit: Admit | None = None) -> ChatGeneration:
        """A checked chat request turned into engine requests (taken from admission), with
        an output parser per choice: what chat completions, Responses and Messages share."""
        tool_parser, reasoning_parser = self.parsers_for(req.chat_template)
        prompt_ids = self._truncate(req, self._render_chat(req))
        if req.forced_tool_call:
            structured, param = forced_call_constraint(req), "tools"
        else:
            structured = req.structured_params()
            param = req.structured_param if structured is not None else None
        thinking = reasoning_parser is not None and not thinking_closed(self._prompt_tail(prompt_ids))
        end_token = self.think_end_token if thinking else None
        if structured is not None and end_token is None:
            thinking = False  # without the engine's switch the grammar binds from the first token: no thinking
        choices = self._choices(engine_id, req, [(prompt_ids, None, "")], req.requested_max_tokens, structured)
        keep_tags = tool_parser == "mistral" and bool(req.tools) and req.effective_tool_choice == "auto"
        eos_text = getattr(self.input_processor.tokenizer, "eos_token", None)
        for choice in choices:
            params = choice.request.sampling_params
            if end_token is not None:
                params.reasoning = ReasoningParams(end_token_id=end_token, budget=req.max_thinking_tokens)
            if keep_tags:
                # [TOOL_CALLS] is a control token of Mistral's vocabularies: decoded for the parser
                # to see, with the end-of-sequence token's text kept out of the answer.
                params.skip_special_tokens = False
                if eos_text and eos_text not in params.stop:
                    params.stop = [*params.stop, eos_text]
        if admit is not None:
            admit(len(choices))
        parsers = {
            c.index: OutputParser(
                ThinkStream(inside=True) if thinking else None,
                tool_call_stream(req, tool_parser),
                ReasoningTokens(end_token) if end_token is not None else None,
            )
            for c in choices
        }
        return ChatGeneration(req, prompt_ids, choices, structured, param, parsers)

    def _prompt_tail(self, prompt_ids: list[int]) -> str:
        """The end of the rendered prompt as text (special tokens kept): enough to see a
        ``<think>`` block the template opened or closed."""
        return self.input_processor.tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)

    @functools.cached_property
    def think_end_token(self) -> int | None:
        """The vocabulary's ``</think>`` token, when it is one token. Only then does the engine
        switch at the end of the reasoning (grammars wait for it, max_thinking_tokens forces
        it) and are reasoning tokens counted; with a ``</think>`` of several tokens the
        reasoning is still parsed from the text, but uncapped, and a grammar applies from
        the first token."""
        ids = self.input_processor.tokenizer.encode(THINK_CLOSE, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    async def collect(self, gen: ChatGeneration) -> list[tuple[RequestOutput, ParsedOutput]]:
        """Every choice's whole output and its parts."""
        outputs = await self._collect_all(gen.choices, gen.param)
        parsed = []
        for choice, out in zip(gen.choices, outputs):
            parser = gen.parsers[choice.index]
            parser.feed(out.text, True, out.token_ids)
            parsed.append((out, parser.parsed()))
        return parsed

    async def stream(self, gen: ChatGeneration) -> AsyncGenerator[tuple[Choice, RequestOutput, OutputDelta], None]:
        """Each output delta of any choice as it comes, with what it adds to that choice's
        parts. Under a grammar the first output is awaited before this returns, so that a
        grammar the engine refuses is still an HTTP error."""
        source = await self._primed(gen.choices, gen.param) if gen.structured is not None else None
        return self._parsed_deltas(gen, source)

    async def _parsed_deltas(
        self, gen: ChatGeneration, source: AsyncGenerator[tuple[Choice, RequestOutput], None] | None
    ) -> AsyncGenerator[tuple[Choice, RequestOutput, OutputDelta], None]:
        outputs = source if source is not None else merged(self.engine.generate, gen.choices)
        async with contextlib.aclosing(outputs):
            async for choice, out in outputs:
                check_output(out, gen.param)
                choice.last = out
                yield choice, out, gen.parsers[choice.index].feed(out.text, out.finished, out.token_ids)

    async def create_chat_completion(self, body: bytes, admit: Admit | None = None) -> Response:
        req, engine_id, request_id = self._open_request(body, ChatCompletionRequest, "chatcmpl")
        gen = self.prepare(req, engine_id, admit)
        if req.stream:
            return await self._stream_response(
                request_id, req, gen.choices, ChatCompletionChunk, self._chat_deltas(req, gen), _role_opening,
                structured=gen.structured, param=gen.param,
            )
        results = await self.collect(gen)
        response_choices = [
            ChatChoice(
                index=choice.index,
                message=AssistantMessage(
                    content=parsed.content, tool_calls=parsed.tool_calls,
                    reasoning_content=parsed.reasoning, reasoning=parsed.reasoning,
                ),
                logprobs=self._chat_logprobs(req, out),
                finish_reason=_finish_reason(out.finish_reason, parsed.tool_calls),
                stop_reason=out.stop_reason,
            )
            for choice, (out, parsed) in zip(gen.choices, results)
        ]
        return json_response(
            ChatCompletionResponse(
                id=request_id,
                created=now(),
                model=self.response_model(req.model),
                choices=response_choices,
                usage=usage_of(gen.choices, [out for out, _ in results]),
                prompt_logprobs=self._prompt_logprobs(req, results[0][0]),
            )
        )

    def _chat_logprobs(self, req: ChatCompletionRequest, out: RequestOutput) -> ChatLogprobs | None:
        if not req.logprobs or out.logprobs is None:
            return None
        return chat_logprobs(self.token_texts, out.logprobs, req.top_logprobs or 0, req.return_tokens_as_token_ids)

    def _chat_deltas(
        self, req: ChatCompletionRequest, gen: ChatGeneration
    ) -> Callable[[Choice, RequestOutput], ChatChunkChoice | None]:
        """The chunk choice of a streamed output (None when it has nothing to say): its
        text, or the tool calls found in the text so far."""

        def delta(choice: Choice, out: RequestOutput) -> ChatChunkChoice | None:
            logprobs = self._chat_logprobs(req, out)
            parser = gen.parsers[choice.index]
            parts = parser.feed(out.text, out.finished, out.token_ids)
            finish_reason = _finish_reason(out.finish_reason, parser.num_calls)
            if not (parts or out.finished or (logprobs is not None and logprobs.content)):
                return None
            reasoning = parts.reasoning or None
            message = DeltaMessage(
                content=parts.content or None, tool_calls=parts.tool_calls or None,
                reasoning_content=reasoning, reasoning=reasoning,
            )
            return ChatChunkChoice(choice.index, message, logprobs, finish_reason, out.stop_reason)

        return delta


@dataclass
class ChatGeneration:
    """A chat request on its way through the engine: its prompt, one engine request per
    choice, the grammar they run under (and the request field it came from, for errors),
    and each choice's output parser (by choice index)."""

    req: ChatCompletionRequest
    prompt_ids: list[int]
    choices: list[Choice]
    structured: StructuredOutputsParams | None
    param: str | None
    parsers: dict[int, OutputParser]


def _finish_reason(reason: str | None, calls: object) -> str | None:
    """A choice that stopped after calling tools finished with "tool_calls", as OpenAI's."""
    return "tool_calls" if calls and reason == "stop" else reason


def _role_opening(choice: Choice) -> ChatChunkChoice:
    """The first chunk of each streamed choice: the assistant's role, empty content."""
    return ChatChunkChoice(choice.index, DeltaMessage(role="assistant", content=""))
