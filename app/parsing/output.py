"""One choice's output taken apart, delta by delta: reasoning first, then the answer's content and tool calls."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from app.parsing.reasoning import ReasoningTokens, ThinkStream
from app.parsing.tool_calls import ToolCallStream
from app.protocol.chat import DeltaToolCall, FunctionCall, ToolCall


@dataclass
class OutputDelta:
    """What one text delta adds: reasoning text, answer text, tool-call fragments (a call's
    first fragment carries its id, type and name; the rest add to its arguments)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass
class ParsedOutput:
    """A whole output: what every API returns, each in its own shape."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]
    # Output tokens spent reasoning, where they can be counted exactly: 0 without reasoning, the
    # count of ReasoningTokens with it; None where they cannot (a </think> of several tokens).
    reasoning_tokens: int | None = None


class OutputParser:
    """Per choice: the reasoning parser (if the model reasons) sees the text first; what
    follows the reasoning goes to the tool-call parser (if tools may be called), else is
    content. ``parsed()`` is the sum of every delta fed so far, so a whole output and its
    stream come apart identically."""

    def __init__(
        self,
        reasoning: ThinkStream | None = None,
        tools: ToolCallStream | None = None,
        reasoning_tokens: ReasoningTokens | None = None,
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.reasoning_tokens = reasoning_tokens
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._arguments: list[list[str]] = []

    def feed(self, text: str, finished: bool, token_ids: Sequence[int] = ()) -> OutputDelta:
        """What the next delta adds (``token_ids``: its tokens, to count the reasoning ones)."""
        delta = OutputDelta()
        if self.reasoning_tokens is not None:
            self.reasoning_tokens.feed(token_ids)
        if self.reasoning is not None:
            delta.reasoning, text = self.reasoning.feed(text, finished)
        if self.tools is not None:
            delta.content, delta.tool_calls = self.tools.feed(text, finished)
        else:
            delta.content = text
        self._record(delta)
        return delta

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def _record(self, delta: OutputDelta) -> None:
        if delta.reasoning:
            self._reasoning.append(delta.reasoning)
        if delta.content:
            self._content.append(delta.content)
        for part in delta.tool_calls:
            function = part.function
            if part.index == len(self._calls):  # a new call: id, type and name
                assert part.id is not None and function is not None and function.name is not None
                self._calls.append(ToolCall(id=part.id, function=FunctionCall(function.name, "")))
                self._arguments.append([])
            if function is not None and function.arguments:
                self._arguments[part.index].append(function.arguments)

    def parsed(self) -> ParsedOutput:
        for call, parts in zip(self._calls, self._arguments):
            call.function.arguments = "".join(parts)
        reasoning = "".join(self._reasoning)
        content = "".join(self._content)
        if self._calls and not content.strip():
            content = ""  # the whitespace around calls is no answer
        counted: int | None = 0  # no reasoning parser: nothing was reasoning
        if self.reasoning is not None:
            counted = self.reasoning_tokens.count if self.reasoning_tokens is not None else None
        return ParsedOutput(reasoning or None, content or None, self._calls, counted)
