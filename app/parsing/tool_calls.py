"""Tool calling on chat: the constraint that forces a call, and which parser reads the calls.

``tool_choice`` "required" or a named function is enforced by a JSON schema
built from the tool definitions (structured outputs), so the output is always
a well-formed call: for a named function, its arguments object; for
"required", vLLM's array ``[{"name": ..., "parameters": {...}}, ...]`` with
one item per call. Both are compact JSON (no free whitespace for the model to
spend tokens on). "auto" lets the model decide, and the parser of its
family's syntax (app/parsing/tool_parsers/, picked per server by
app/parsing/detect.py) finds the calls in its text.

Should the forced form be the model's own syntax (``<tool_call>{...}</tool_call>``
for Hermes and Qwen, ``[TOOL_CALLS]name[ARGS]{...}`` for Mistral Small, ...)?
For the quality of the arguments, yes: a model steered token by token into a
neutral JSON array it was never trained on writes its arguments off its usual
path, while inside its own tags it writes them as it learnt to, and the turn
it leaves in the conversation is one its template shows back to it as
written. It is not done yet because the neutral form needs one schema for
every family and no per-family grammar (each family's tags around the same
argument schemas, and a reasoning model's thinking before them), while the
client sees the same ``tool_calls`` either way; the per-family constraint is
the next step, with each parser reading its own forced output.

Streams: the ``*Stream`` classes turn text deltas into OpenAI's
``delta.content`` and ``delta.tool_calls`` fragments (id, type and name
first, then the arguments), which the official client reassembles.
"""

from __future__ import annotations

import json
from typing import Any

from app.parsing.tool_parsers import TOOL_CALL_PARSERS, call_ids_of
from app.parsing.tool_parsers.base import (
    IdFactory,
    JsonSpan,
    ToolCallStream,
    dumps,
    new_tool_call_id,
)
from app.protocol.chat import (
    ChatCompletionRequest,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)
from core.protocol import StructuredOutputsParams

_OBJECT = {"type": "object"}


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


def parse_forced(req: ChatCompletionRequest, text: str, new_id: IdFactory = new_tool_call_id) -> list[ToolCall]:
    """The calls of a forced output, as its stream gives them: for a named function, one
    call with the text as its arguments (cut short if max_tokens cut them, as OpenAI
    returns them); for "required", every call of the array that was completed, so an
    output cut by max_tokens keeps the calls written before the cut."""
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        return [ToolCall(id=new_id(), function=FunctionCall(choice.function.name, text))] if text else []
    stream = RequiredCallStream(new_id)
    stream.feed(text, finished=True)
    return stream.calls


class NamedCallStream(ToolCallStream):
    """A named tool_choice: the text is the arguments, streamed as they come."""

    def __init__(self, name: str, new_id: IdFactory = new_tool_call_id) -> None:
        super().__init__(None, new_id)
        self.name = name

    def feed(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        if not text:
            return "", []
        if self.num_calls == 0:
            return "", [self.head(self.name, text)]
        return "", [self.more(text)]


class RequiredCallStream(ToolCallStream):
    """tool_choice "required": each call of the array is sent once its object closes
    (``calls`` keeps them all)."""

    def __init__(self, new_id: IdFactory = new_tool_call_id) -> None:
        super().__init__(None, new_id)
        self.calls: list[ToolCall] = []
        self.opened = False  # the array's "[" was read
        self.item: JsonSpan | None = None  # the object being read, from the buffer's start

    def feed(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        self.buffer += text
        if not self.opened:
            at = self.buffer.find("[")
            if at < 0:
                return "", []
            self.buffer, self.opened = self.buffer[at + 1 :], True
        deltas: list[DeltaToolCall] = []
        while True:
            if self.item is None:
                at = self.buffer.find("{")
                if at < 0:  # separators, or the array's end
                    self.buffer = ""
                    break
                self.buffer, self.item = self.buffer[at:], JsonSpan()
            end = self.item.end(self.buffer)
            if end is None:
                break
            deltas += self._emit(self.buffer[:end])
            self.buffer, self.item = self.buffer[end:], None
        return "", deltas

    def _emit(self, body: str) -> list[DeltaToolCall]:
        try:
            value = json.loads(body)
        except ValueError:
            return []
        head = self.head(value["name"], dumps(value["parameters"]))
        assert head.id is not None and head.function is not None and head.function.arguments is not None
        self.calls.append(ToolCall(id=head.id, function=FunctionCall(value["name"], head.function.arguments)))
        return [head]


def tool_schemas(req: ChatCompletionRequest) -> dict[str, dict[str, Any]]:
    """The request's tools by name, each with its parameters' schema."""
    return {t.function.name: t.function.parameters or {} for t in req.tools or ()}


def tool_call_stream(req: ChatCompletionRequest, auto_parser: str | None) -> ToolCallStream | None:
    """The stream parser a chat request needs, if any: the forced forms, or the model's own
    syntax (``auto_parser``, a TOOL_CALL_PARSERS name) when it may choose to call. Without a
    parser for the model's syntax, tool_choice "auto" answers in plain text."""
    choice, new_id = req.tool_choice, call_ids_of(auto_parser)
    if isinstance(choice, NamedToolChoice):
        return NamedCallStream(choice.function.name, new_id)
    if req.forced_tool_call:
        return RequiredCallStream(new_id)
    if req.tools and req.effective_tool_choice == "auto" and auto_parser is not None:
        return TOOL_CALL_PARSERS[auto_parser](tool_schemas(req))
    return None
