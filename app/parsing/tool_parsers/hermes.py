"""Hermes-style calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

As the templates of Hermes 2/3, Qwen2.5 and Qwen3 show them to the model (one
block per call, a newline inside each tag). The answer is the text before the
first block; a block that is no call of a known tool stays in the content as
written. A block that starts ``{"name": "f", "arguments": {`` (as the
templates write calls) is a call from there on: its name is sent, then its
arguments as they are written; any other block is judged whole once it
closes (or at the end, for a block the output left open).
"""

from __future__ import annotations

from app.parsing.text import partial_suffix
from app.parsing.tool_parsers.base import (
    CALL_PREFIX,
    IdFactory,
    StreamedCall,
    ToolCallStream,
    ToolSchemas,
    new_tool_call_id,
)
from app.protocol.chat import DeltaToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesStream(ToolCallStream):
    """Content until ``<tool_call>``, then each call once its block closes; text after
    the calls is not part of the answer."""

    def __init__(self, tools: ToolSchemas | None = None, new_id: IdFactory = new_tool_call_id) -> None:
        super().__init__(tools, new_id)
        self.inside = False
        self.call: StreamedCall | None = None  # a call whose arguments are being sent
        self.closing = False  # a streamed call's object closed: skipping to </tool_call>

    def feed(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        self.buffer += text
        content, deltas = "", []
        while True:
            if not self.inside:
                text, found = self.text_until(OPEN, finished)
                content += text
                if not found:
                    break
                self.inside = True
            if self.call is None and not self.closing:
                prefix = CALL_PREFIX.match(self.buffer)
                if prefix is not None and self.known(prefix.group(1)):
                    deltas.append(self.head(prefix.group(1)))
                    self.buffer, self.call = self.buffer[prefix.end() :], StreamedCall()
            if self.call is not None:
                piece, used, done = self.call.feed(self.buffer)
                if piece:
                    deltas.append(self.more(piece))
                self.buffer = self.buffer[used:]
                if not done:
                    break
                self.call, self.closing = None, True
            if self.closing:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    keep = 0 if finished else partial_suffix(self.buffer, CLOSE)
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                self.buffer, self.inside, self.closing = self.buffer[end + len(CLOSE) :], False, False
                continue
            end = self.buffer.find(CLOSE)
            if end < 0 and not finished:
                break
            body = self.buffer if end < 0 else self.buffer[:end]
            self.buffer = "" if end < 0 else self.buffer[end + len(CLOSE) :]
            self.inside = False
            call = self.call_in(body)
            if call is None:
                if self.num_calls == 0:
                    content += OPEN + body + ("" if end < 0 else CLOSE)
            else:
                deltas.append(self.head(*call))
            if end < 0:
                break
        return content, deltas
