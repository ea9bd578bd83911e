"""/v1/responses: OpenAI's Responses API request, its input and output items, the response object.

The request is decoded with unknown fields refused (a 400 naming the field);
the fields that mean nothing on a local server but that the official clients
and agents send on every turn (cache keys, service tiers, reasoning
summaries...) are declared in ``IGNORED`` and accepted. Input items are
decoded one by one by their ``type`` (a message may omit it), leniently
within an item: the items a client sends back are the output items of an
earlier response, with whatever fields that response carried.
"""

from __future__ import annotations

import re
import uuid
from typing import Any, ClassVar

import msgspec

from app.errors import BadRequestError

# Reasoning efforts that turn thinking off, and those that leave it on (OpenAI's values).
EFFORTS_OFF = ("none", "minimal")
EFFORTS_ON = ("low", "medium", "high", "xhigh")


def new_id(prefix: str) -> str:
    """OpenAI's ids: ``resp_...``, ``msg_...``, ``fc_...``, ``rs_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ------------------------------------------------------------------ the request


class TextFormat(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """``text.format``: text, json_object, or json_schema with the schema inline (flat,
    unlike chat's ``response_format.json_schema``)."""

    type: str
    name: str | None = None
    schema: dict[str, Any] | bool | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # for OpenAI's models; nothing here


class ReasoningConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    effort: str | None = None
    summary: str | None = None  # summaries are not written here: the reasoning is returned whole
    generate_summary: str | None = None  # the older name of summary


class FunctionTool(msgspec.Struct, kw_only=True):
    """A flat function tool (``{type: "function", name, parameters, ...}``)."""

    name: str
    type: str = "function"
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    store: bool | None = None
    stream: bool | None = None
    # vLLM's sampling extensions, as on chat.
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    priority: int = 0
    cache_salt: str | None = None
    # Accepted and ignored (IGNORED says why).
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None
    service_tier: str | None = None
    truncation: str | None = None
    stream_options: Any = None
    max_tool_calls: int | None = None
    context_management: Any = None
    client_metadata: Any = None
    personality: Any = None
    # Refused unless neutral (REFUSED says why).
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None

    IGNORED: ClassVar[dict[str, str]] = {
        "user": "an end-user identifier for OpenAI's abuse monitoring",
        "safety_identifier": "an end-user identifier for OpenAI's abuse monitoring",
        "prompt_cache_key": "prefix caching here needs no routing hint",
        "prompt_cache_retention": "cached prefixes stay until the KV cache needs their blocks",
        "prompt_cache_options": "cached prefixes stay until the KV cache needs their blocks",
        "service_tier": "there is one service tier",
        "truncation": "a prompt longer than the context is refused, never cut",
        "stream_options": "stream events are never obfuscated",
        "max_tool_calls": "the server runs no built-in tools",
        "context_management": "conversations are not compacted by the server",
        "client_metadata": "client telemetry",
        "personality": "for OpenAI's models",
        "include": "reasoning is returned as text; there is no encrypted reasoning, logprobs or search output",
    }
    REFUSED: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {
        "background": ((None, False), "responses are not run in the background"),
        "conversation": ((None,), "there is no conversations API; continue with previous_response_id"),
        "prompt": ((None,), "there are no stored prompt templates"),
        "top_logprobs": ((None, 0), "logprobs are not returned on responses; use /v1/chat/completions"),
    }

    def check_supported(self) -> list[str]:
        """400 for a refused field set to anything but a neutral value; the names of the
        ignored fields that were set (for a debug line)."""
        for name, (accepted, reason) in self.REFUSED.items():
            value = getattr(self, name)
            if not any(value == ok and type(value) is type(ok) for ok in accepted):
                raise BadRequestError(f"{name} is not supported: {reason}.", name)
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise BadRequestError("max_output_tokens must be at least 1.", "max_output_tokens")
        effort = self.reasoning.effort if self.reasoning is not None else None
        if effort is not None and effort not in EFFORTS_OFF + EFFORTS_ON:
            raise BadRequestError(
                f"reasoning.effort must be one of {', '.join(EFFORTS_OFF + EFFORTS_ON)}, got {effort!r}.",
                "reasoning.effort",
            )
        if isinstance(self.input, str) and not self.input and self.previous_response_id is None:
            raise BadRequestError("input must not be empty.", "input")
        return [name for name in self.IGNORED if getattr(self, name) is not None]

    @property
    def chat_reasoning_effort(self) -> str | None:
        """reasoning.effort as chat's reasoning_effort (thinking off for none and minimal,
        on otherwise; chat knows no "xhigh")."""
        effort = self.reasoning.effort if self.reasoning is not None else None
        return "high" if effort == "xhigh" else effort

    @property
    def stored(self) -> bool:
        return self.store is None or self.store  # OpenAI's default: stored


# ------------------------------------------------------------------ input items


class ContentPart(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A part of a message's content: input_text / output_text / refusal are text;
    anything else (images, files, audio) cannot be read by this server."""

    type: str
    text: str | None = None
    refusal: str | None = None


class MessageItem(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart]
    type: str = "message"
    id: str | None = None
    status: str | None = None


class FunctionCallItem(msgspec.Struct, kw_only=True):
    call_id: str
    name: str
    arguments: str
    type: str = "function_call"
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(msgspec.Struct, kw_only=True):
    call_id: str
    output: str | list[ContentPart]
    type: str = "function_call_output"
    id: str | None = None
    status: str | None = None


class ReasoningText(msgspec.Struct, kw_only=True):
    text: str
    type: str = "reasoning_text"


class ReasoningItem(msgspec.Struct, kw_only=True):
    id: str | None = None
    type: str = "reasoning"
    summary: list[dict[str, Any]] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}
MESSAGE_ROLES = ("user", "assistant", "system", "developer")


def decode_items(raw: str | list[dict[str, Any]]) -> list[InputItem]:
    """The request's input as items (a string is one user message); a 400 naming the
    item for an unknown type, a missing or mistyped field, content that is not text."""
    if isinstance(raw, str):
        return [MessageItem(role="user", content=raw)] if raw else []
    items = []
    for i, entry in enumerate(raw):
        kind = entry.get("type", "message")
        item_type = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if item_type is None:
            raise BadRequestError(
                f"input[{i}]: unknown item type {kind!r} (this server reads {', '.join(ITEM_TYPES)}).",
                f"input[{i}].type",
            )
        try:
            item = msgspec.convert(entry, item_type)
        except msgspec.ValidationError as exc:
            raise BadRequestError(f"input[{i}]: {exc}", error_path(f"input[{i}]", exc)) from None
        _check_item(item, i)
        items.append(item)
    return items


_AT = re.compile(r" - at `\$([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def error_path(where: str, exc: msgspec.ValidationError) -> str:
    """The field a msgspec error inside ``where`` is about (``input[2].content``)."""
    at, missing = _AT.search(str(exc)), _MISSING.search(str(exc))
    path = where + (at.group(1) if at is not None else "")
    return f"{path}.{missing.group(1)}" if missing is not None else path


def _check_item(item: InputItem, i: int) -> None:
    if isinstance(item, MessageItem):
        if item.role not in MESSAGE_ROLES:
            raise BadRequestError(f"input[{i}].role must be one of {', '.join(MESSAGE_ROLES)}, got {item.role!r}.",
                                  f"input[{i}].role")
        parts = item.content if isinstance(item.content, list) else []
        field = "content"
    elif isinstance(item, FunctionCallOutputItem):
        parts = item.output if isinstance(item.output, list) else []
        field = "output"
    else:
        return
    for j, part in enumerate(parts):
        if part.type in TEXT_PARTS and part_text(part) is None:
            raise BadRequestError(f"input[{i}].{field}[{j}]: the {part.type} part has no text.",
                                  f"input[{i}].{field}[{j}]")
        if part_text(part) is None:
            raise BadRequestError(
                f"input[{i}].{field}[{j}]: only text parts can be read here, not {part.type!r}.",
                f"input[{i}].{field}[{j}].type",
            )


TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def part_text(part: ContentPart) -> str | None:
    if part.type in ("input_text", "output_text", "text") and part.text is not None:
        return part.text
    if part.type == "refusal" and part.refusal is not None:
        return part.refusal
    return None


def content_text(content: str | list[ContentPart]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part_text(p) or "" for p in content)


# ------------------------------------------------------------------ output


class OutputText(msgspec.Struct, kw_only=True):
    text: str
    type: str = "output_text"
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(msgspec.Struct, kw_only=True):
    id: str
    content: list[OutputText]
    status: str = "in_progress"
    type: str = "message"
    role: str = "assistant"


class OutputReasoning(msgspec.Struct, kw_only=True):
    id: str
    content: list[ReasoningText]
    status: str = "in_progress"
    type: str = "reasoning"
    summary: list[Any] = []


class OutputFunctionCall(msgspec.Struct, kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "in_progress"
    type: str = "function_call"


OutputItem = OutputMessage | OutputReasoning | OutputFunctionCall


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseError(msgspec.Struct):
    code: str
    message: str


class ResponseObject(msgspec.Struct, kw_only=True):
    """The response, whole (and in the lifecycle events of a stream)."""

    id: str
    created_at: int
    model: str
    status: str
    output: list[OutputItem]
    instructions: str | None
    metadata: dict[str, str]
    tools: list[FunctionTool]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    max_output_tokens: int | None
    previous_response_id: str | None
    reasoning: ReasoningConfig | None
    text: TextConfig
    store: bool
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    completed_at: int | None = None
    object: str = "response"
    background: bool = False
    truncation: str = "disabled"
    service_tier: str = "default"


class InputItemList(msgspec.Struct):
    """``GET /v1/responses/{id}/input_items``: one page, as OpenAI's cursor pages."""

    data: list[Any]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"


_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def with_ids(items: list[InputItem]) -> list[InputItem]:
    """Input items as a stored response lists them: each with an id, a status, and a
    message's content as parts."""
    for item in items:
        if item.id is None:
            item.id = new_id(_ITEM_ID_PREFIXES[item.type])
        if item.status is None:
            item.status = "completed"
        if isinstance(item, MessageItem) and isinstance(item.content, str):
            kind = "output_text" if item.role == "assistant" else "input_text"
            item.content = [ContentPart(type=kind, text=item.content)]
    return items


class InputTokensResponse(msgspec.Struct):
    input_tokens: int
    object: str = "response.input_tokens"


class DeletedResponse(msgspec.Struct):
    id: str
    object: str = "response"
    deleted: bool = True
