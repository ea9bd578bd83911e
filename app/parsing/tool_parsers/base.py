"""What every tool-call stream parser shares: the call ids, the fragments it sends, a JSON span finder.

A parser is fed text deltas (a whole output is one final delta) and answers
with the content they complete and the tool-call fragments they complete:
a call's first fragment carries its index, id, type and name, later ones add
to its arguments. Everything a parser decides depends only on the text seen
so far, never on where the deltas were split, so the joined fragments of a
stream equal the arguments of the whole output.
"""

from __future__ import annotations

import abc
import json
import re
import secrets
import string
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from app.parsing.text import held_back
from app.protocol.chat import DeltaFunctionCall, DeltaToolCall

# A tool's name -> its parameters' JSON schema (an empty one when the tool declares none).
ToolSchemas = Mapping[str, dict[str, Any]]
IdFactory = Callable[[], str]


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


_ALNUM = string.ascii_letters + string.digits


def new_mistral_call_id() -> str:
    """Nine letters and digits: Mistral's templates refuse any other call id when the
    conversation comes back with the call in it."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class ToolCallStream(abc.ABC):
    """Per choice: text deltas in, (content delta, tool-call fragments) out.

    ``tools``: the request's tools by name, when calls naming another function are
    to be left as content (None: any name is taken)."""

    def __init__(self, tools: ToolSchemas | None = None, new_id: IdFactory = new_tool_call_id) -> None:
        self.num_calls = 0
        self.tools = tools
        self.new_id = new_id
        self.buffer = ""  # text fed and not yet answered for

    @abc.abstractmethod
    def feed(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        """The content and tool-call fragments that ``text`` (the next delta) completes."""

    def text_until(self, marker: str, finished: bool, past_marker: bool = True) -> tuple[str, bool]:
        """Take the buffer's text up to ``marker``: (the content it adds, whether the marker
        came). Found, the buffer then starts past the marker (or at it: ``past_marker``
        False) and the whitespace before it is dropped; not found, what may begin it is
        held back. Text after the first call is no content (as the templates write
        turns, nothing follows a model's calls but more calls)."""
        at = self.buffer.find(marker)
        if at < 0:
            keep = 0 if finished else held_back(self.buffer, marker)
            text, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        else:
            text = self.buffer[:at].rstrip()
            self.buffer = self.buffer[at + len(marker) if past_marker else at :]
        return (text if self.num_calls == 0 else ""), at >= 0

    def call_in(self, body: str, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[str, str] | None:
        """(name, arguments) of a JSON call object's text, or None when it is not valid JSON,
        not a call, or calls a tool the request did not offer."""
        try:
            call = call_of(json.loads(body), arguments_keys)
        except ValueError:
            return None
        return call if call is not None and self.known(call[0]) else None

    def known(self, name: str) -> bool:
        return self.tools is None or name in self.tools

    def head(self, name: str, arguments: str | None = None) -> DeltaToolCall:
        """The first fragment of a new call (its arguments too, when they are all known)."""
        self.num_calls += 1
        return DeltaToolCall(
            index=self.num_calls - 1, id=self.new_id(), type="function",
            function=DeltaFunctionCall(name=name, arguments=arguments),
        )

    def more(self, arguments: str) -> DeltaToolCall:
        """A further piece of the arguments of the latest call."""
        return DeltaToolCall(index=self.num_calls - 1, function=DeltaFunctionCall(arguments=arguments))


def call_of(value: Any, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a decoded ``{"name": ..., "arguments": {...}}``
    object, or None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    for key in arguments_keys:
        if key in value:
            arguments = value[key]
            break
    else:
        arguments = {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], dumps(arguments)


class JsonSpan:
    """Where the JSON object or array at the start of a growing text ends: fed the same
    text, longer each time, it scans only what is new (``depth`` 1: the text is inside
    one already, and ends at its closing bracket)."""

    def __init__(self, depth: int = 0) -> None:
        self.pos = 0
        self.depth = depth
        self.in_string = self.escaped = False

    def end(self, text: str) -> int | None:
        """The index just past the value's closing bracket, or None while it is open."""
        while self.pos < len(text):
            ch = text[self.pos]
            self.pos += 1
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
                if self.depth == 0:
                    return self.pos
        return None


# The start of a JSON call whose arguments can be sent as they are written: its name first,
# then its arguments object (the order every template here shows).
CALL_PREFIX = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


class StreamedCall:
    """The rest of a JSON call object whose name was read (CALL_PREFIX): its arguments object
    sent as the model writes it, then what follows skipped up to the call's closing brace.
    Fed the unread text each time; what it answers depends only on the text, never on how
    it was split."""

    def __init__(self) -> None:
        self.arguments = JsonSpan()
        self.rest: JsonSpan | None = None

    def feed(self, text: str) -> tuple[str, int, bool]:
        """(arguments text to send, how much of ``text`` is used up, the call's object closed)."""
        piece, used = "", 0
        if self.rest is None:
            end = self.arguments.end(text)
            if end is None:
                self.arguments.pos = 0  # all of it is used: the next text is new
                return text, len(text), False
            piece, used, self.rest = text[:end], end, JsonSpan(depth=1)
        close = self.rest.end(text[used:])
        if close is None:
            self.rest.pos = 0
            return piece, len(text), False
        return piece, used + close, True
