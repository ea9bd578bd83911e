"""Mistral calls, after ``[TOOL_CALLS]``, in either of the two forms Mistral's templates use.

- Mistral Nemo (and the v3 tokenizer's models) write one JSON array:
  ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``; an item that starts
  with its name and then its arguments object has them sent as they come, any
  other is judged once its object closes.
- Mistral Small 3.2 (and later v11+ models) write each call as
  ``[TOOL_CALLS]f[ARGS]{...}`` (the template also shows ``[CALL_ID]id`` before
  ``[ARGS]``, which is skipped): the name is sent at ``[ARGS]``, then the
  arguments as they come, up to the end of their JSON object.

The answer is the text before the first ``[TOOL_CALLS]``. A call naming no
known tool stays content. Call ids are nine letters and digits, the only ones
Mistral's templates accept when the conversation comes back. ``[TOOL_CALLS]``
is a control token in Mistral's own vocabularies: it reaches the text only
when special tokens are decoded, which the chat route asks for when this
parser reads the output.
"""

from __future__ import annotations

from app.parsing.tool_parsers.base import (
    CALL_PREFIX,
    IdFactory,
    JsonSpan,
    StreamedCall,
    ToolCallStream,
    ToolSchemas,
    new_mistral_call_id,
)
from app.protocol.chat import DeltaToolCall

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


class MistralStream(ToolCallStream):
    def __init__(self, tools: ToolSchemas | None = None, new_id: IdFactory = new_mistral_call_id) -> None:
        super().__init__(tools, new_id)
        self.state = "text"  # text -> tag -> (array | name -> arguments) -> text
        self.span: JsonSpan | None = None
        self.call: StreamedCall | None = None  # an array item whose arguments are being sent

    def feed(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        self.buffer += text
        content, deltas = "", []
        while True:
            if self.state == "text":
                text, found = self.text_until(TOOL_CALLS, finished)
                content += text
                if not found:
                    break
                self.state = "tag"
            if self.state == "tag":
                rest = self.buffer.lstrip()
                if not rest:
                    if finished:
                        self.buffer = ""
                    break
                self.buffer = rest
                self.state = "array" if rest.startswith("[") else "name"
                if self.state == "array":
                    self.buffer = rest[1:]
            if self.state == "array":
                done, more = self._array_items(finished, deltas)
                content += more
                if not done:
                    break
                continue
            if self.state == "name":
                ends = [i for i in (self.buffer.find(ARGS), self.buffer.find(CALL_ID)) if i >= 0]
                if not ends:
                    if finished:
                        content += self._not_a_call(self.buffer)
                        self.buffer = ""
                    break
                at = min(ends)
                name = self.buffer[:at].strip()
                args_at = self.buffer.find(ARGS, at)
                if args_at < 0:  # [CALL_ID] seen: wait for [ARGS]
                    if finished:
                        content += self._not_a_call(self.buffer)
                        self.buffer = ""
                    break
                if not name or any(c.isspace() for c in name) or not self.known(name):
                    content += self._not_a_call(self.buffer[: args_at + len(ARGS)])
                    self.buffer = self.buffer[args_at + len(ARGS) :]
                    self.state = "text"
                    continue
                self.buffer = self.buffer[args_at + len(ARGS) :]
                deltas.append(self.head(name))
                self.state, self.span = "arguments", JsonSpan()
            if self.state == "arguments":
                assert self.span is not None
                end = self.span.end(self.buffer)
                upto = len(self.buffer) if end is None else end
                if upto:
                    deltas.append(self.more(self.buffer[:upto]))
                self.buffer = self.buffer[upto:]
                self.span.pos -= upto
                if end is None:
                    break
                self.state, self.span = "text", None
        return content, deltas

    def _not_a_call(self, text: str) -> str:
        return TOOL_CALLS + text if self.num_calls == 0 else ""

    def _array_items(self, finished: bool, deltas: list[DeltaToolCall]) -> tuple[bool, str]:
        """Calls of the array as they come; (the array is over, content)."""
        while True:
            if self.call is not None:
                piece, used, done = self.call.feed(self.buffer)
                if piece:
                    deltas.append(self.more(piece))
                self.buffer = self.buffer[used:]
                if not done:
                    return False, ""
                self.call = None
                continue
            if self.span is None:
                rest = self.buffer.lstrip().lstrip(",").lstrip()
                self.buffer = rest
                if rest.startswith("]"):
                    self.buffer, self.state = rest[1:], "text"
                    return True, ""
                if not rest:
                    return False, ""
                if not rest.startswith("{"):
                    self.state = "text"  # not an array of calls after all: the rest is text
                    return True, self._not_a_call("[") if self.num_calls == 0 else ""
                self.span = JsonSpan()
            prefix = CALL_PREFIX.match(self.buffer)
            if prefix is not None and self.known(prefix.group(1)):
                deltas.append(self.head(prefix.group(1)))
                self.buffer, self.span, self.call = self.buffer[prefix.end() :], None, StreamedCall()
                continue
            end = self.span.end(self.buffer)
            if end is None and not finished:
                return False, ""
            body = self.buffer if end is None else self.buffer[:end]
            self.buffer = "" if end is None else self.buffer[end:]
            self.span = None
            call = self.call_in(body)
            if call is None:
                self.state = "text"
                return True, self._not_a_call("[" + body)
            deltas.append(self.head(*call))
            if end is None:
                return False, ""
