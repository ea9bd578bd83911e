"""/v1/chat/completions: messages, tools and tool calls, the response and its streamed chunks."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from app.errors import BadRequestError
from app.protocol.common import PromptLogprobs, UsageInfo
from app.protocol.sampling import REFUSED_COMMON, SamplingFields
from core.protocol import MAX_LOGPROBS


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    function: FunctionCall
    type: str = "function"


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(msgspec.Struct, kw_only=True):
    function: FunctionDefinition
    type: str = "function"

    def to_template_dict(self) -> dict[str, Any]:
        """As OpenAI's clients send a tool (type first, no field that was not given): templates
        print the dict as it is (tojson), so its keys and their order are the prompt's."""
        function = {k: v for k, v in msgspec.to_builtins(self.function).items() if v is not None}
        return {"type": self.type, "function": function}


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """``tool_choice`` naming the one function the model must call."""

    function: NamedFunction
    type: str = "function"


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant turn that called tools, and a tool's result answering one call.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # An assistant turn's reasoning, as vLLM takes it back (both names, one meaning).
    reasoning_content: str | None = None
    reasoning: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: content flattened to text."""
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise BadRequestError(
                        f"Only text content parts are supported (got {part.type!r}).", "messages"
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        else:
            content = self.content or ""
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:  # the Qwen3 template writes it back inside <think>
            message["reasoning_content"] = reasoning
        if self.tool_calls is not None:
            # Templates index into the arguments: a dict where they are JSON, as vLLM hands them.
            message["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _arguments(c)}}
                for c in self.tool_calls
            ]
        return message


def _arguments(call: ToolCall) -> Any:
    try:
        value = msgspec.json.decode(call.function.arguments)
    except msgspec.DecodeError:
        return call.function.arguments
    return value if isinstance(value, dict) else call.function.arguments


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: str | NamedToolChoice | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    echo: bool = False
    continue_final_message: bool = False
    documents: Any = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    functions: Any = None
    function_call: Any = None
    web_search_options: Any = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    verbosity: str | None = None
    # Thinking: at most this many output tokens of reasoning before the model is made to
    # end it (a reasoning model's end-of-thinking token; ringllm's field, Anthropic's budget_tokens).
    max_thinking_tokens: int | None = None

    implemented: ClassVar[frozenset[str]] = SamplingFields.implemented | {
        "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
        "tool_choice", "chat_template", "chat_template_kwargs", "add_generation_prompt", "add_special_tokens",
        "parallel_tool_calls", "reasoning_effort", "max_thinking_tokens",
    }
    refused: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {
        **REFUSED_COMMON,
        "echo": ((False,), "chat does not echo the last message; /v1/completions echoes prompts"),
        "continue_final_message": ((False,), "the final message cannot be continued yet"),
        "documents": ((None,), "retrieval templates get no documents"),
        "modalities": ((None, ["text"]), "only text output is produced"),
        "audio": ((None,), "there is no audio output"),
        "prediction": ((None,), "there are no predicted outputs"),
        "functions": ((None,), "the legacy functions API is not implemented; use tools"),
        "function_call": ((None,), "the legacy functions API is not implemented; use tool_choice"),
        "web_search_options": ((None,), "there is no web search"),
        "store": ((None, False), "this server stores no completions"),
        "metadata": ((None,), "this server stores no completions to tag"),
        "service_tier": ((None, "auto", "default"), "there is one service tier"),
        "verbosity": ((None,), "answers are not shortened or lengthened on request; max_tokens caps them"),
    }

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise BadRequestError("messages must not be empty.", "messages")
        self._check_tools()
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise BadRequestError("top_logprobs needs logprobs set to true.", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise BadRequestError(
                    f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}.", "top_logprobs"
                )
        if self.prompt_logprobs is not None and self.stream:
            raise BadRequestError("prompt_logprobs are not available on a streamed chat.", "prompt_logprobs")
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            raise BadRequestError(
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {self.reasoning_effort!r}.",
                "reasoning_effort",
            )
        if self.max_thinking_tokens is not None and self.max_thinking_tokens < 0:
            raise BadRequestError("max_thinking_tokens must be at least 0.", "max_thinking_tokens")
        thinking = (self.chat_template_kwargs or {}).get("enable_thinking")
        if thinking is not None and not isinstance(thinking, bool):
            raise BadRequestError("chat_template_kwargs.enable_thinking must be true or false.",
                                  "chat_template_kwargs")

    def _check_tools(self) -> None:
        choice = self.tool_choice
        names = [t.function.name for t in self.tools or ()]
        if any(t.type != "function" for t in self.tools or ()):
            raise BadRequestError("Only tools of type function are supported.", "tools")
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise BadRequestError(
                f"tool_choice must be none, auto, required or a named function, got {choice!r}.", "tool_choice"
            )
        if choice not in (None, "none") and not names:
            raise BadRequestError(
                f"Tool calling needs tools: tool_choice is {_choice_name(choice)} but no tools were given.",
                "tool_choice",
            )
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise BadRequestError(f"tool_choice names {choice.function.name!r}, which is not among the tools.",
                                  "tool_choice")
        if self.forced_tool_call and self.structured_params() is not None:
            raise BadRequestError(
                "A required or named tool_choice constrains the output already: drop response_format / "
                "structured_outputs.", "tool_choice",
            )

    @property
    def enable_thinking(self) -> bool | None:
        """Thinking asked on or off: ``chat_template_kwargs.enable_thinking`` (the templates'
        own switch) wins, else reasoning_effort (none/minimal: off, low/medium/high: on);
        None when the request says nothing (the template's default)."""
        explicit = (self.chat_template_kwargs or {}).get("enable_thinking")
        if explicit is not None:
            return bool(explicit)
        if self.reasoning_effort is not None:
            return self.reasoning_effort not in ("none", "minimal")
        return None

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template is given beyond the messages and tools: the request's
        chat_template_kwargs, with enable_thinking set from reasoning_effort when only that was sent."""
        kwargs = dict(self.chat_template_kwargs or {})
        thinking = self.enable_thinking
        if thinking is not None:
            kwargs["enable_thinking"] = thinking
        return kwargs

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """As OpenAI: "auto" when tools are given without a choice, "none" without tools."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    @property
    def forced_tool_call(self) -> bool:
        """tool_choice "required" or a named function: the output must be a call."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are sent.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def _choice_name(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


class AssistantMessage(msgspec.Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCall] = []
    # The model's reasoning (a thinking model's <think> block): vLLM's older and newer names.
    reasoning_content: str | None = None
    reasoning: str | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """A fragment of tool call ``index``: id, type and name come first, then arguments in pieces."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: UsageInfo | None = None
