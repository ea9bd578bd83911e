"""/v1/chat/completions: the chat template, tool calls (forced or parsed), chat logprobs; whole or streamed."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from starlette.responses import Response

from app.choices import Choice
from app.errors import BadRequestError
from app.logprobs import chat_logprobs
from app.output_processor import RequestOutput
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
    json_response,
    usage_of,
)
from app.tool_calls import (
    forced_call_constraint,
    parse_forced,
    parse_hermes,
    tool_call_stream,
)
from core.protocol import StructuredOutputsParams


class OpenAIServingChat(OpenAIServing):
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

    async def create_chat_completion(self, body: bytes, admit: Admit | None = None) -> Response:
        req, engine_id, request_id = self._open_request(body, ChatCompletionRequest, "chatcmpl")
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
            return await self._stream_response(
                request_id, req, choices, ChatCompletionChunk, self._chat_deltas(req, choices), _role_opening,
                structured=structured, param=param,
            )
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
                model=self.response_model(req.model),
                choices=response_choices,
                usage=usage_of(choices, outputs),
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

    def _chat_logprobs(self, req: ChatCompletionRequest, out: RequestOutput) -> ChatLogprobs | None:
        if not req.logprobs or out.logprobs is None:
            return None
        return chat_logprobs(self.token_texts, out.logprobs, req.top_logprobs or 0, req.return_tokens_as_token_ids)

    def _chat_deltas(
        self, req: ChatCompletionRequest, choices: list[Choice]
    ) -> Callable[[Choice, RequestOutput], ChatChunkChoice | None]:
        """The chunk choice of a streamed output (None when it has nothing to say): its
        text, or the tool calls found in the text so far."""
        tool_streams = {c.index: tool_call_stream(req, self.tool_call_parser) for c in choices}

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

        return delta


def _role_opening(choice: Choice) -> ChatChunkChoice:
    """The first chunk of each streamed choice: the assistant's role, empty content."""
    return ChatChunkChoice(choice.index, DeltaMessage(role="assistant", content=""))
