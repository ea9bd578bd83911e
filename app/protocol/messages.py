"""/v1/messages (Anthropic's Messages API): the request, its translation into a chat request, the
response and its stream events.

A Messages request is served as the ``ChatCompletionRequest`` it amounts to (``to_chat``): the
system prompt and the turns become chat messages (tool_use blocks the assistant's tool_calls,
tool_result blocks "tool" messages), the tools chat's function tools, ``thinking`` the template's
``enable_thinking`` and a cap on the reasoning. The request's own fields are decoded strictly:
an unknown field or block type is a 400 naming it; the fields Anthropic's clients send that
mean nothing on this server (``IGNORED``) are accepted and logged at debug level.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, ClassVar

import msgspec

from app.errors import BadRequestError
from app.protocol.chat import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolCall,
    ToolDefinition,
)
from app.protocol.sampling import JsonSchemaFormat, ResponseFormat

logger = logging.getLogger("ringllm.serving")

# Anthropic's server tools (web_search_20250305, bash_20250124, text_editor_20250728, ...) are
# typed by name and date; this server cannot run them.
_SERVER_TOOL = re.compile(r"^[a-z][a-z0-9_]*_\d{8}$")

# ------------------------------------------------------------------ request


class _Block(msgspec.Struct, tag_field="type", kw_only=True, forbid_unknown_fields=True):
    cache_control: Any = None  # a prompt-cache breakpoint: prefix caching here needs none


class TextBlockParam(_Block, tag="text"):
    text: str
    citations: Any = None


class ImageBlockParam(msgspec.Struct, tag_field="type", tag="image", kw_only=True):
    """Decoded to be refused by name: the server reads text only."""

    source: Any = None


class DocumentBlockParam(msgspec.Struct, tag_field="type", tag="document", kw_only=True):
    source: Any = None


class ToolUseBlockParam(_Block, tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]
    caller: Any = None
    toolset_name: str | None = None


class ToolReferenceBlockParam(_Block, tag="tool_reference"):
    """In a tool's result: the deferred tool (``defer_loading``) of that name is loaded."""

    tool_name: str


ResultBlockParam = TextBlockParam | ImageBlockParam | DocumentBlockParam | ToolReferenceBlockParam


class ToolResultBlockParam(_Block, tag="tool_result"):
    tool_use_id: str
    content: str | list[ResultBlockParam] = ""
    is_error: bool = False
    toolset_name: str | None = None


class ThinkingBlockParam(_Block, tag="thinking"):
    thinking: str
    signature: str = ""


class RedactedThinkingBlockParam(_Block, tag="redacted_thinking"):
    data: str


BlockParam = (
    TextBlockParam
    | ImageBlockParam
    | DocumentBlockParam
    | ToolUseBlockParam
    | ToolResultBlockParam
    | ThinkingBlockParam
    | RedactedThinkingBlockParam
)


class MessageParam(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[BlockParam]


class ToolChoiceParam(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str  # auto | any | tool | none
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingParam(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str  # enabled | disabled | adaptive
    budget_tokens: int | None = None
    display: str | None = None  # summarized | omitted


class JsonOutputFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    effort: str | None = None  # how hard a Claude model tries: nothing to set here
    format: JsonOutputFormat | None = None
    task_budget: Any = None


class CustomTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Accepted, nothing to do with them here: cache breakpoints, programmatic callers, how
    # finely the input streams (as it is parsed, here), examples (chat templates show none).
    IGNORED: ClassVar[tuple[str, ...]] = ("cache_control", "allowed_callers", "eager_input_streaming", "input_examples")

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: str | None = None  # "custom" or absent
    strict: bool | None = None
    cache_control: Any = None
    allowed_callers: Any = None
    defer_loading: bool | None = None  # shown to the model only once a tool_reference names it
    eager_input_streaming: Any = None
    input_examples: Any = None


class MessagesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of POST /v1/messages, and of /v1/messages/count_tokens (which needs no
    ``max_tokens``)."""

    model: str
    messages: list[MessageParam]
    max_tokens: int | None = None
    system: str | list[TextBlockParam] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None  # the beta's older place for output_config.format
    mcp_servers: list[Any] | None = None
    metadata: Any = None
    cache_control: Any = None
    service_tier: str | None = None
    container: Any = None
    context_management: Any = None
    diagnostics: Any = None
    inference_geo: Any = None
    speed: Any = None

    # Accepted, and nothing to do with them here: user ids, prompt-cache breakpoints, capacity
    # tiers, code-execution containers, server-side context editing, cache-miss diagnostics,
    # where and how fast Anthropic runs the model.
    IGNORED: ClassVar[tuple[str, ...]] = (
        "metadata", "cache_control", "service_tier", "container", "context_management", "diagnostics",
        "inference_geo", "speed",
    )

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request this one amounts to (400 naming the field for what cannot be served)."""
        for name in self.IGNORED:
            if getattr(self, name) is not None:
                logger.debug("/v1/messages: ignoring %s (it means nothing on this server)", name)
        if self.mcp_servers:
            raise BadRequestError("mcp_servers are not supported: this server connects to no MCP server.",
                                  "mcp_servers")
        references: dict[str, str] = {}  # deferred tools loaded by a tool_reference -> where
        messages = self._chat_messages(references)
        tools, tool_choice, parallel = self._tools(references)
        kwargs: dict[str, Any] = {}
        max_thinking = None
        if self.thinking is not None:
            kwargs["enable_thinking"], max_thinking = self._thinking()
        return ChatCompletionRequest(
            model=self.model,
            messages=messages,
            max_tokens=self.max_tokens,
            stop=self.stop_sequences,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel,
            chat_template_kwargs=kwargs or None,
            response_format=self._response_format(),
            max_thinking_tokens=max_thinking,
        )

    @property
    def omit_thinking(self) -> bool:
        return self.thinking is not None and self.thinking.display == "omitted"

    def _chat_messages(self, references: dict[str, str]) -> list[ChatMessage]:
        """The turns as chat messages, after one system message: ``system`` and then the
        system turns of ``messages`` (Claude Code sends its environment as one, last), since
        chat templates take a single system prompt first (Mistral Nemo's refuses a system turn
        anywhere else; SmolLM3's drops it)."""
        system: list[ContentPart] = []
        if self.system is not None:
            system += _parts(_text(self.system, "system"))
        messages = []
        calls: set[str] = set()
        for i, message in enumerate(self.messages):
            if message.role == "system":
                system += _parts(_text(message.content, f"messages[{i}].content"))  # type: ignore[arg-type]
            else:
                messages += _turn(message, f"messages[{i}]", calls, references)
        if system:
            messages.insert(0, ChatMessage("system", system))
        if self.messages and self.messages[-1].role == "assistant":
            raise BadRequestError(
                "The last message is the assistant's: continuing (prefilling) an assistant turn is not "
                "supported; end with a user turn.", "messages",
            )
        return messages

    def _tools(
        self, references: dict[str, str]
    ) -> tuple[list[ToolDefinition] | None, str | NamedToolChoice | None, bool | None]:
        """The custom tools the model is shown: a deferred one (``defer_loading``, Claude Code's
        tool search) once a tool_reference in a tool's result has loaded it."""
        tools = []
        names: set[str] = set()
        ignored: set[str] = set()
        for i, raw in enumerate(self.tools or ()):
            kind = raw.get("type")
            if kind not in (None, "custom"):
                if isinstance(kind, str) and _SERVER_TOOL.match(kind):
                    logger.info("/v1/messages: ignoring the server tool %r (%s): this server cannot run it",
                                raw.get("name"), kind)
                    continue
                raise BadRequestError(f"tools[{i}].type: unknown tool type {kind!r}.", f"tools[{i}].type")
            try:
                tool = msgspec.convert(raw, CustomTool)
            except msgspec.ValidationError as exc:
                raise BadRequestError(f"tools[{i}]: {exc}", f"tools[{i}]") from None
            _check_schema(tool.input_schema, f"tools[{i}].input_schema")
            ignored.update(name for name in tool.IGNORED if getattr(tool, name) is not None)
            names.add(tool.name)
            if tool.defer_loading and tool.name not in references:
                continue
            tools.append(ToolDefinition(function=FunctionDefinition(
                name=tool.name, description=tool.description, parameters=tool.input_schema, strict=tool.strict,
            )))
        if ignored:
            logger.debug("/v1/messages: ignoring tools' %s (they mean nothing on this server)", ", ".join(sorted(ignored)))
        for name, where in references.items():
            if name not in names:
                raise BadRequestError(f"{where}: the tool_reference names {name!r}, which is not among the tools.",
                                      where)
        choice = self.tool_choice
        if choice is None:
            return tools or None, None, None
        parallel = False if choice.disable_parallel_tool_use else None
        if choice.type == "auto":
            chat_choice: str | NamedToolChoice | None = "auto" if tools else None
        elif choice.type == "none":
            chat_choice = "none" if tools else None
        elif choice.type == "any":
            chat_choice = "required"
        elif choice.type == "tool":
            if not choice.name:
                raise BadRequestError("tool_choice.name: a tool choice of type tool names the tool.",
                                      "tool_choice.name")
            chat_choice = NamedToolChoice(function=NamedFunction(choice.name))
        else:
            raise BadRequestError(
                f"tool_choice.type must be auto, any, tool or none, got {choice.type!r}.", "tool_choice.type"
            )
        return tools or None, chat_choice, parallel

    def _thinking(self) -> tuple[bool, int | None]:
        thinking = self.thinking
        assert thinking is not None
        if thinking.display not in (None, "summarized", "omitted"):
            raise BadRequestError(
                f"thinking.display must be summarized or omitted, got {thinking.display!r}.", "thinking.display"
            )
        if thinking.type == "disabled":
            return False, None
        if thinking.type == "adaptive":
            return True, None
        if thinking.type == "enabled":
            if thinking.budget_tokens is None or thinking.budget_tokens < 1:
                raise BadRequestError("thinking.budget_tokens: a positive number of tokens is required.",
                                      "thinking.budget_tokens")
            return True, thinking.budget_tokens
        raise BadRequestError(
            f"thinking.type must be enabled, disabled or adaptive, got {thinking.type!r}.", "thinking.type"
        )

    def _response_format(self) -> ResponseFormat | None:
        config_format = self.output_config.format if self.output_config is not None else None
        for name in ("effort", "task_budget"):
            if self.output_config is not None and getattr(self.output_config, name) is not None:
                logger.debug("/v1/messages: ignoring output_config.%s (it means nothing on this server)", name)
        if config_format is not None and self.output_format is not None:
            raise BadRequestError("Give output_config.format or output_format, not both.", "output_format")
        fmt, param = (config_format, "output_config.format") if config_format is not None else (
            self.output_format, "output_format")
        if fmt is None:
            return None
        if fmt.type != "json_schema":
            raise BadRequestError(f"{param}.type must be json_schema, got {fmt.type!r}.", f"{param}.type")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(schema=fmt.schema))


def _check_schema(schema: dict[str, Any], param: str) -> None:
    """What Anthropic asks of a tool's input schema: an object schema with well-formed
    properties (the rest is the grammar compiler's to judge, when a call is forced)."""
    if schema.get("type") != "object":
        raise BadRequestError(f'{param}.type must be "object".', param)
    properties = schema.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(p, (dict, bool)) for p in properties.values()):
        raise BadRequestError(f"{param}.properties must map names to schemas.", param)
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise BadRequestError(f"{param}.required must be a list of property names.", param)


def _text(
    content: str | list[TextBlockParam] | list[ResultBlockParam], param: str,
    references: dict[str, str] | None = None,
) -> str | list[ContentPart]:
    """Text content as chat has it: a string, or text parts (which chat joins). In a tool's
    result (``references`` given), a tool_reference loads that tool and says so."""
    if isinstance(content, str):
        return content
    parts = []
    for j, block in enumerate(content):
        if isinstance(block, ToolReferenceBlockParam) and references is not None:
            references.setdefault(block.tool_name, f"{param}[{j}].tool_name")
            parts.append(ContentPart("text", f"Tool {block.tool_name} loaded."))
            continue
        if not isinstance(block, TextBlockParam):
            _refuse_block(block, f"{param}[{j}]")
        parts.append(ContentPart("text", block.text))
    return parts


def _parts(content: str | list[ContentPart]) -> list[ContentPart]:
    return [ContentPart("text", content)] if isinstance(content, str) else content


def _refuse_block(block: Any, param: str) -> None:
    kind = block.__struct_config__.tag
    if kind in ("image", "document"):
        raise BadRequestError(f"{param}: {kind} blocks are not supported: this server reads text only.", param)
    raise BadRequestError(f"{param}: a {kind} block has no place here.", param)


def _turn(message: MessageParam, param: str, calls: set[str], references: dict[str, str]) -> list[ChatMessage]:
    """One Anthropic turn as chat messages: a user turn's tool_result blocks become "tool"
    messages (in their order among its text), an assistant turn's tool_use blocks its
    tool_calls and its thinking its reasoning_content."""
    role = message.role
    if role not in ("user", "assistant"):
        raise BadRequestError(f"{param}.role must be user, assistant or system, got {role!r}.", f"{param}.role")
    if isinstance(message.content, str):
        return [ChatMessage(role, message.content)]
    if role == "assistant":
        return [_assistant(message.content, f"{param}.content", calls)]
    out: list[ChatMessage] = []
    texts: list[ContentPart] = []
    for j, block in enumerate(message.content):
        where = f"{param}.content[{j}]"
        if isinstance(block, TextBlockParam):
            texts.append(ContentPart("text", block.text))
        elif isinstance(block, ToolResultBlockParam):
            if block.tool_use_id not in calls:
                raise BadRequestError(
                    f"{where}.tool_use_id: no earlier tool_use block has the id {block.tool_use_id!r}.",
                    f"{where}.tool_use_id",
                )
            if texts:
                out.append(ChatMessage("user", texts))
                texts = []
            result = _text(block.content, f"{where}.content", references)
            if block.is_error:  # chat has no flag for it: the model reads it
                result = [ContentPart("text", "Error:"), *([ContentPart("text", result)] if isinstance(result, str)
                                                          else result)]
            out.append(ChatMessage("tool", result, tool_call_id=block.tool_use_id))
        else:
            _refuse_block(block, where)
    if texts or not out:
        out.append(ChatMessage("user", texts))
    return out


def _assistant(blocks: list[Any], param: str, calls: set[str]) -> ChatMessage:
    """The thinking blocks become the turn's reasoning_content, for the templates that write
    it back (Qwen3's, after the last user turn); redacted thinking is nothing to read."""
    texts: list[ContentPart] = []
    thinking: list[str] = []
    tool_calls: list[ToolCall] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlockParam):
            texts.append(ContentPart("text", block.text))
        elif isinstance(block, ToolUseBlockParam):
            calls.add(block.id)
            arguments = json.dumps(block.input, ensure_ascii=False)
            tool_calls.append(ToolCall(id=block.id, function=FunctionCall(block.name, arguments)))
        elif isinstance(block, ThinkingBlockParam):
            thinking.append(block.thinking)
        elif not isinstance(block, RedactedThinkingBlockParam):
            _refuse_block(block, f"{param}[{j}]")
    return ChatMessage("assistant", texts or None, tool_calls=tool_calls or None,
                       reasoning_content="".join(thinking) if thinking else None)


# ------------------------------------------------------------------ response


class TextBlock(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking"):
    thinking: str
    # Anthropic signs its thinking so that it can check it when it is sent back; this server
    # takes back whatever thinking it is sent (as the turn's reasoning), so it signs nothing:
    # always "", which the clients accept and send back as it came.
    signature: str = ""


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class Usage(msgspec.Struct):
    """As Anthropic counts: ``input_tokens`` excludes the prompt tokens read from the
    prefix cache (``cache_read_input_tokens``); the prompt is their sum."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, output_tokens: int, cached_tokens: int) -> Usage:
        return cls(prompt_tokens - cached_tokens, output_tokens, cached_tokens, 0)


class Message(msgspec.Struct):
    id: str
    model: str
    content: list[ContentBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    type: str = "message"
    role: str = "assistant"


class TokenCount(msgspec.Struct):
    input_tokens: int


# ------------------------------------------------------------------ stream events


class TextDelta(msgspec.Struct, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDelta(msgspec.Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


class InputJsonDelta(msgspec.Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class MessageStart(msgspec.Struct, tag_field="type", tag="message_start"):
    message: Message


class Ping(msgspec.Struct, tag_field="type", tag="ping"):
    pass


class ContentBlockStart(msgspec.Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: ContentBlock


class ContentBlockDelta(msgspec.Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStop(msgspec.Struct, tag_field="type", tag="content_block_stop"):
    index: int


class StopDelta(msgspec.Struct):
    stop_reason: str | None
    stop_sequence: str | None


class MessageDelta(msgspec.Struct, tag_field="type", tag="message_delta"):
    delta: StopDelta
    usage: Usage  # the totals, which replace message_start's


class MessageStop(msgspec.Struct, tag_field="type", tag="message_stop"):
    pass


StreamEvent = (
    MessageStart | Ping | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop
)


# ------------------------------------------------------------------ errors


class ErrorDetail(msgspec.Struct):
    type: str
    message: str


class ErrorResponse(msgspec.Struct, tag_field="type", tag="error"):
    """Anthropic's error body, also the ``error`` event of a failed stream."""

    error: ErrorDetail
