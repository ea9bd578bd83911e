"""Reasoning parsers: the text between ``<think>`` and ``</think>`` is the model's reasoning.

Qwen3 and the DeepSeek-R1 distills write their thinking inside ``<think>`` tags;
the chat template may already have opened the tag in the prompt (the R1 distills
always do; Qwen3 does not, and writes an empty block when thinking is off), so
the parser is told whether the output starts inside the reasoning. An output
cut before ``</think>`` is all reasoning.
"""

from __future__ import annotations

from app.parsing.text import partial_suffix

REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ThinkStream:
    """Per choice: text deltas in, (reasoning, the rest) out. ``inside``: the prompt
    ended with an opened ``<think>``. Before any reasoning, the model may open the tag
    itself (after whitespace only); text that starts otherwise has no reasoning."""

    def __init__(self, inside: bool = False) -> None:
        self.state = "inside" if inside else "before"  # before -> inside -> after
        self.buffer = ""
        self.answer_started = False  # newlines right after </think> are not part of the answer

    @property
    def ended(self) -> bool:
        """The reasoning is over (or there was none): the rest is the answer."""
        return self.state == "after"

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        self.buffer += text
        reasoning = rest = ""
        if self.state == "before":
            head = self.buffer.lstrip()
            if head.startswith(THINK_OPEN):
                self.buffer, self.state = head[len(THINK_OPEN):], "inside"
            elif THINK_OPEN.startswith(head) and not finished:
                return "", ""  # maybe the start of the tag: wait for more
            else:
                self.state, self.answer_started = "after", True  # no reasoning: the text is the answer as written
        if self.state == "inside":
            at = self.buffer.find(THINK_CLOSE)
            if at >= 0:
                reasoning, self.buffer = self.buffer[:at], self.buffer[at + len(THINK_CLOSE):]
                self.state = "after"
            else:
                keep = 0 if finished else partial_suffix(self.buffer, THINK_CLOSE)
                reasoning, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return reasoning, ""
        if self.state == "after":
            rest, self.buffer = self.buffer, ""
            if not self.answer_started:
                rest = rest.lstrip("\n")
                self.answer_started = bool(rest)
        return reasoning, rest
