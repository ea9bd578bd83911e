"""Qwen3-Coder calls: XML-like blocks with one tag per parameter.

As the Qwen3-Coder template asks for them and writes them back::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    value
    </parameter>
    </function>
    </tool_call>

A value is plain text (the newline after its opening tag and before its
closing tag is the template's, not the value's); it becomes the JSON type the
tool's schema declares for that parameter: a string stays text, numbers,
booleans, objects and arrays are read as JSON (a value that does not read as
one stays text). The name is sent once ``<function=NAME>`` is complete, then
the arguments object a parameter at a time as each closes, and its closing
brace at ``</function>`` (or at the end of a cut output). The answer is the
text before the first block; a block naming no known tool stays content.
"""

from __future__ import annotations

import json
from typing import Any

from app.parsing.tool_parsers.base import IdFactory, ToolCallStream, ToolSchemas, dumps, new_tool_call_id
from app.protocol.chat import DeltaToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_TEXT_TYPES = {"string", None}


def _declared_type(schema: dict[str, Any], key: str) -> str | None:
    spec = (schema.get("properties") or {}).get(key)
    if not isinstance(spec, dict):
        return None
    kind = spec.get("type")
    if isinstance(kind, list):  # ["integer", "null"]: the first that is not null
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else None


def json_value(text: str, kind: str | None) -> Any:
    """A parameter's text as the JSON value its declared type asks for."""
    if kind in _TEXT_TYPES:
        return text
    candidate = text.strip()
    if kind == "boolean":
        candidate = candidate.lower()
    try:
        return json.loads(candidate)
    except ValueError:
        return text


class Qwen3CoderStream(ToolCallStream):
    def __init__(self, tools: ToolSchemas | None = None, new_id: IdFactory = new_tool_call_id) -> None:
        super().__init__(tools, new_id)
        self.state = "text"  # text -> block -> parameters -> closing -> text
        self.name = ""
        self.num_parameters = 0

    def feed(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        self.buffer += text
        content, deltas = "", []
        while True:
            if self.state == "text":
                text, found = self.text_until(OPEN, finished)
                content += text
                if not found:
                    break
                self.state = "block"
            if self.state == "block":
                rest = self.buffer.lstrip()
                if not rest.startswith(FUNCTION):
                    if not finished and FUNCTION.startswith(rest):
                        break
                    content += self._not_a_call()
                    continue
                end = rest.find(">")
                if end < 0:
                    if not finished and "\n" not in rest:
                        break
                    content += self._not_a_call()
                    continue
                name = rest[len(FUNCTION) : end].strip()
                if not name or not self.known(name):
                    content += self._not_a_call()
                    continue
                self.buffer, self.name, self.num_parameters = rest[end + 1 :], name, 0
                deltas.append(self.head(name))
                self.state = "parameters"
            if self.state == "parameters":
                rest = self.buffer.lstrip()
                if rest.startswith(FUNCTION_END) or (finished and not rest.startswith(PARAMETER)):
                    deltas.append(self.more("}" if self.num_parameters else "{}"))
                    self.buffer = rest[len(FUNCTION_END) :] if rest.startswith(FUNCTION_END) else ""
                    self.state = "closing"
                    continue
                if not rest.startswith(PARAMETER):
                    if FUNCTION_END.startswith(rest) or PARAMETER.startswith(rest):
                        break  # not finished: wait for the tag
                    # Neither a parameter nor the end: the call is over where its parameters stop.
                    deltas.append(self.more("}" if self.num_parameters else "{}"))
                    self.buffer, self.state = rest, "closing"
                    continue
                name_end = rest.find(">")
                value_end = rest.find(PARAMETER_END, name_end + 1) if name_end >= 0 else -1
                if value_end < 0 and not finished:
                    break
                key = rest[len(PARAMETER) : name_end].strip() if name_end >= 0 else rest[len(PARAMETER) :].strip()
                value = rest[name_end + 1 : value_end if value_end >= 0 else len(rest)] if name_end >= 0 else ""
                value = value.removeprefix("\n").removesuffix("\n")
                self.buffer = rest[value_end + len(PARAMETER_END) :] if value_end >= 0 else ""
                schema = (self.tools or {}).get(self.name) or {}
                piece = f"{dumps(key)}: {dumps(json_value(value, _declared_type(schema, key)))}"
                deltas.append(self.more(("{" if self.num_parameters == 0 else ", ") + piece))
                self.num_parameters += 1
                continue
            if self.state == "closing":
                rest = self.buffer.lstrip()
                if not rest and not finished:
                    break
                if rest.startswith(CLOSE):
                    rest = rest[len(CLOSE) :]
                elif not finished and CLOSE.startswith(rest):
                    break
                self.buffer, self.state = rest, "text"
                if finished and not rest:
                    break
        return content, deltas

    def _not_a_call(self) -> str:
        """A ``<tool_call>`` that opens no call of a known tool: its tag is text after all
        (the buffer, still holding the rest, is read as text next)."""
        self.state = "text"
        return OPEN if self.num_calls == 0 else ""
