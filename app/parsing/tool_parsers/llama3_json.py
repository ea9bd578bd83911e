"""Llama 3.x calls: ``{"name": ..., "parameters": {...}}`` as the whole answer.

The Llama 3.1/3.2 templates ask for "JSON for a function call" in the format
``{"name": function name, "parameters": dictionary of argument name and its
value}`` and write a past call back that way. The model may put
``<|python_tag|>`` first (a special token: in the text only when special
tokens are decoded) and may write several calls separated by ``;``. So an
output is calls when it starts with ``{`` (or has ``<|python_tag|>``, the
text before it being the answer). An object that starts ``{"name": "f",
"parameters": {`` is a call from there on (its arguments sent as they are
written); any other object is judged once it closes. An object that is not a
call of a known tool, and any text after the calls begin, are content only
while no call was found.
"""

from __future__ import annotations

from app.parsing.tool_parsers.base import (
    CALL_PREFIX,
    IdFactory,
    JsonSpan,
    StreamedCall,
    ToolCallStream,
    ToolSchemas,
    new_tool_call_id,
)
from app.protocol.chat import DeltaToolCall

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonStream(ToolCallStream):
    def __init__(self, tools: ToolSchemas | None = None, new_id: IdFactory = new_tool_call_id) -> None:
        super().__init__(tools, new_id)
        self.state = "start"  # start -> calls | text (-> calls at a python tag)
        self.span: JsonSpan | None = None
        self.call: StreamedCall | None = None  # a call whose arguments are being sent

    def feed(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        self.buffer += text
        content, deltas = "", []
        while True:
            if self.state == "start":
                head = self.buffer.lstrip()
                if head.startswith(PYTHON_TAG) or head.startswith("{"):
                    self.state = "calls"
                elif not finished and (not head or PYTHON_TAG.startswith(head)):
                    break  # too early to tell
                else:
                    self.state = "text"
            if self.state == "text":
                text, found = self.text_until(PYTHON_TAG, finished, past_marker=False)
                content += text
                if not found:
                    break
                self.state = "calls"
            # calls: objects, with separators and python tags between them
            if self.call is not None:
                piece, used, done = self.call.feed(self.buffer)
                if piece:
                    deltas.append(self.more(piece))
                self.buffer = self.buffer[used:]
                if not done:
                    break
                self.call = None
                continue
            if self.span is None:
                rest = self.buffer.lstrip().lstrip(";").lstrip()
                while rest.startswith(PYTHON_TAG):
                    rest = rest[len(PYTHON_TAG) :].lstrip().lstrip(";").lstrip()
                self.buffer = rest
                if not rest or (not finished and PYTHON_TAG.startswith(rest)):
                    if finished:
                        self.buffer = ""
                    break
                if not rest.startswith("{"):
                    self.state = "text"  # no further call: what follows is not a call
                    continue
                self.span = JsonSpan()
            prefix = CALL_PREFIX.match(self.buffer)
            if prefix is not None and self.known(prefix.group(1)):
                deltas.append(self.head(prefix.group(1)))
                self.buffer, self.span, self.call = self.buffer[prefix.end() :], None, StreamedCall()
                continue
            end = self.span.end(self.buffer)
            if end is None and not finished:
                break
            body = self.buffer if end is None else self.buffer[:end]
            self.buffer = "" if end is None else self.buffer[end:]
            self.span = None
            call = self.call_in(body, ("parameters", "arguments"))
            if call is None:
                self.state = "text"
                if self.num_calls == 0:
                    content += body
            else:
                deltas.append(self.head(*call))
            if end is None:
                break
        return content, deltas
