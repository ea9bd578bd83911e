"""Tool calling on chat: the constraint that forces a call, and the parsers that find calls.

``tool_choice`` "required" or a named function is enforced by a JSON schema
built from the tool definitions (structured outputs), so the output is always
a well-formed call: for a named function, its arguments object; for
"required", vLLM's array ``[{"name": ..., "parameters": {...}}, ...]`` with
one item per call. Both are compact JSON (no free whitespace for the model to
spend tokens on). "auto" lets the model decide, and a parser finds the calls
in its text: Hermes-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks (``--tool-call-parser hermes``), as the templates of Hermes, Qwen2.5
and Qwen3 write them.

Streams: the ``*Stream`` classes turn text deltas into OpenAI's
``delta.content`` and ``delta.tool_calls`` fragments (id, type and name
first, then the arguments), which the official client reassembles.
"""

from __future__ import annotations

import abc
import json
import re
import uuid
from typing import Any

from app.parsing.text import partial_suffix
from app.protocol.chat import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)
from core.protocol import StructuredOutputsParams

_OBJECT = {"type": "object"}


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _parameters(req: ChatCompletionRequest, name: str) -> dict[str, Any]:
    for tool in req.tools or ():
        if tool.function.name == name:
            return tool.function.parameters or _OBJECT
    raise KeyError(name)


def forced_call_constraint(req: ChatCompletionRequest) -> StructuredOutputsParams:
    """The JSON schema every output of a "required" or named tool_choice matches."""
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        schema: dict[str, Any] = _parameters(req, choice.function.name)
    else:
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": tool.function.parameters or _OBJECT,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for tool in req.tools or ()
        ]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
    return StructuredOutputsParams(json=json.dumps(schema), disable_any_whitespace=True)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def parse_forced(req: ChatCompletionRequest, text: str) -> list[ToolCall]:
    """The calls of a forced output, as its stream gives them: for a named function, one
    call with the text as its arguments (cut short if max_tokens cut them, as OpenAI
    returns them); for "required", every call of the array that was completed, so an
    output cut by max_tokens keeps the calls written before the cut."""
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        return [ToolCall(id=new_tool_call_id(), function=FunctionCall(choice.function.name, text))] if text else []
    stream = RequiredCallStream()
    stream.feed(text, finished=True)
    return stream.calls


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _hermes_call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else _dumps(arguments)
    return ToolCall(id=new_tool_call_id(), function=FunctionCall(value["name"], text))


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content before the calls, the calls) of a Hermes-style output; a block that is
    not a valid call leaves the whole text as content, as vLLM's parser does."""
    if _HERMES_OPEN not in text:
        return text, []
    calls = [_hermes_call(body.strip()) for body in _HERMES_BLOCK.findall(text)]
    if not calls or any(c is None for c in calls):
        return text, []
    content = text[: text.index(_HERMES_OPEN)].strip()
    return content or None, [c for c in calls if c is not None]


def _whole_call_delta(index: int, call: ToolCall) -> DeltaToolCall:
    return DeltaToolCall(
        index=index, id=call.id, type="function",
        function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
    )


class ToolCallStream(abc.ABC):
    """Per choice: text deltas in, (content delta, tool-call fragments) out."""

    def __init__(self) -> None:
        self.num_calls = 0

    @abc.abstractmethod
    def feed(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        """The content and tool-call fragments that ``text`` (the next delta) completes."""


class NamedCallStream(ToolCallStream):
    """A named tool_choice: the text is the arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        if not text:
            return "", []
        if self.num_calls == 0:
            self.num_calls = 1
            head = DeltaToolCall(
                index=0, id=new_tool_call_id(), type="function",
                function=DeltaFunctionCall(name=self.name, arguments=text),
            )
            return "", [head]
        return "", [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))]


class RequiredCallStream(ToolCallStream):
    """tool_choice "required": each call of the array is sent once its object closes
    (``calls`` keeps them all)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[ToolCall] = []
        self.depth = 0
        self.in_string = self.escaped = False
        self.item: list[str] = []

    def feed(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        deltas = []
        for ch in text:
            if self.depth >= 1 and not (self.depth == 1 and ch in ",]" and not self.in_string):
                self.item.append(ch)
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and ch == "}":  # an item of the array is complete
                    deltas += self._emit("".join(self.item).strip())
                    self.item = []
        return "", deltas

    def _emit(self, body: str) -> list[DeltaToolCall]:
        try:
            value = json.loads(body)
        except ValueError:
            return []
        call = ToolCall(id=new_tool_call_id(), function=FunctionCall(value["name"], _dumps(value["parameters"])))
        self.calls.append(call)
        self.num_calls += 1
        return [_whole_call_delta(self.num_calls - 1, call)]


class HermesStream(ToolCallStream):
    """"auto" with the Hermes parser: content until ``<tool_call>``, then each call
    once its block closes (or at the end, for a last block left open)."""

    def __init__(self) -> None:
        super().__init__()
        self.buffer = ""
        self.inside = False

    def feed(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        self.buffer += text
        content, deltas = "", []
        while True:
            if not self.inside:
                at = self.buffer.find(_HERMES_OPEN)
                if at < 0:
                    # Held back: what may begin a tag, and trailing whitespace (dropped before a call).
                    keep = 0
                    if not finished:
                        head = self.buffer[: len(self.buffer) - partial_suffix(self.buffer, _HERMES_OPEN)]
                        keep = len(self.buffer) - len(head.rstrip())
                    if self.num_calls == 0:  # text after the calls is not content, as in parse_hermes
                        content += self.buffer[: len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                content += self.buffer[:at].rstrip() if self.num_calls == 0 else ""
                self.buffer = self.buffer[at + len(_HERMES_OPEN) :]
                self.inside = True
            end = self.buffer.find(_HERMES_CLOSE)
            if end < 0 and not finished:
                break
            body = self.buffer if end < 0 else self.buffer[:end]
            self.buffer = "" if end < 0 else self.buffer[end + len(_HERMES_CLOSE) :]
            self.inside = False
            call = _hermes_call(body.strip())
            if call is None:
                content += _HERMES_OPEN + body + ("" if end < 0 else _HERMES_CLOSE)
            else:
                deltas.append(_whole_call_delta(self.num_calls, call))
                self.num_calls += 1
            if end < 0:
                break
        return content, deltas


# The parsers of tool_choice "auto", by --tool-call-parser name: each makes a new stream per choice.
TOOL_CALL_PARSERS: dict[str, type[ToolCallStream]] = {"hermes": HermesStream}


def tool_call_stream(req: ChatCompletionRequest, auto_parser: str | None) -> ToolCallStream | None:
    """The stream parser a chat request needs, if any: the forced forms, or the model's own
    syntax (``auto_parser``) when it may choose to call."""
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        return NamedCallStream(choice.function.name)
    if req.forced_tool_call:
        return RequiredCallStream()
    if req.tools and req.effective_tool_choice == "auto" and auto_parser is not None:
        return TOOL_CALL_PARSERS[auto_parser]()
    return None
