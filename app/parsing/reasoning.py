"""Reasoning parsers: the text between ``<think>`` and ``</think>`` is the model's reasoning.

Qwen3, SmolLM3 and the DeepSeek-R1 distills write their thinking inside
``<think>`` tags. The chat template may open the tag in the prompt (the R1
distills do), close it there to turn thinking off (Qwen3 with
``enable_thinking`` false writes an empty block), or leave both to the model.
``qwen3`` and ``deepseek_r1`` therefore read outputs alike, and the rendered
prompt says which case a request is (``thinking_closed``): a prompt that
closed the block gets no reasoning parser; otherwise the output starts inside
the reasoning, with the model's own ``<think>`` first if it writes one, and
lasts until ``</think>``: an output cut before it is all reasoning. That is
also what the engine is told (``ReasoningParams``: grammars apply after the
end-of-thinking token), so the two never disagree on where the answer begins.
"""

from __future__ import annotations

from collections.abc import Sequence

from app.parsing.text import partial_suffix

REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def thinking_closed(prompt_tail: str) -> bool:
    """The rendered prompt ends with the reasoning block already closed (thinking is off)."""
    return prompt_tail.rstrip().endswith(THINK_CLOSE)


class ThinkStream:
    """Per choice: text deltas in, (reasoning, the rest) out.

    ``inside``: the output starts in the reasoning (a ``<think>`` the model writes
    first, after whitespace only, is dropped). Otherwise the model may open the tag
    itself, and text that starts otherwise has no reasoning."""

    def __init__(self, inside: bool = True) -> None:
        self.state = "opening" if inside else "before"  # (opening | before) -> inside -> after
        self.buffer = ""
        self.answer_started = False  # newlines right after </think> are not part of the answer

    @property
    def ended(self) -> bool:
        """The reasoning is over (or there was none): the rest is the answer."""
        return self.state == "after"

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        self.buffer += text
        reasoning = rest = ""
        if self.state in ("opening", "before"):
            head = self.buffer.lstrip()
            if head.startswith(THINK_OPEN):
                self.buffer, self.state = head[len(THINK_OPEN):], "inside"
            elif THINK_OPEN.startswith(head) and not finished:
                return "", ""  # maybe the start of the tag: wait for more
            elif self.state == "opening":
                self.state = "inside"  # the prompt opened the reasoning: the text is reasoning as written
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


class ReasoningTokens:
    """How many output tokens were reasoning, counted exactly on the token ids: every
    token up to and including the end-of-thinking token (all of them while it has not
    come). Only where ``</think>`` is one token of the vocabulary."""

    def __init__(self, end_token_id: int) -> None:
        self.end_token_id = end_token_id
        self.count = 0
        self.ended = False

    def feed(self, token_ids: Sequence[int]) -> None:
        if self.ended:
            return
        for token in token_ids:
            self.count += 1
            if token == self.end_token_id:
                self.ended = True
                return
