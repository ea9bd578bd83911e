"""Hermes-style calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

As the templates of Hermes 2/3, Qwen2.5 and Qwen3 show them to the model (one
block per call, a newline inside each tag). The answer is the text before the
first block; a block that is no call of a known tool stays in the content as
written. Each call is sent whole once its block closes (its JSON cannot be
judged before), or at the end for a block the output left open.
"""

from __future__ import annotations

import json

from app.parsing.text import held_back
from app.parsing.tool_parsers.base import IdFactory, ToolCallStream, ToolSchemas, call_of, new_tool_call_id
from app.protocol.chat import DeltaToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesStream(ToolCallStream):
    """Content until ``<tool_call>``, then each call once its block closes; text after
    the calls is not part of the answer."""

    def __init__(self, tools: ToolSchemas | None = None, new_id: IdFactory = new_tool_call_id) -> None:
        super().__init__(tools, new_id)
        self.buffer = ""
        self.inside = False

    def feed(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        self.buffer += text
        content, deltas = "", []
        while True:
            if not self.inside:
                at = self.buffer.find(OPEN)
                if at < 0:
                    keep = 0 if finished else held_back(self.buffer, OPEN)
                    if self.num_calls == 0:
                        content += self.buffer[: len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                if self.num_calls == 0:
                    content += self.buffer[:at].rstrip()
                self.buffer = self.buffer[at + len(OPEN) :]
                self.inside = True
            end = self.buffer.find(CLOSE)
            if end < 0 and not finished:
                break
            body = self.buffer if end < 0 else self.buffer[:end]
            self.buffer = "" if end < 0 else self.buffer[end + len(CLOSE) :]
            self.inside = False
            call = self._call(body)
            if call is None:
                if self.num_calls == 0:
                    content += OPEN + body + ("" if end < 0 else CLOSE)
            else:
                deltas.append(self.head(*call))
            if end < 0:
                break
        return content, deltas

    def _call(self, body: str) -> tuple[str, str] | None:
        try:
            call = call_of(json.loads(body))
        except ValueError:
            return None
        return call if call is not None and self.known(call[0]) else None
