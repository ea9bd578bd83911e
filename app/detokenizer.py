"""Incremental detokenization: turn a growing list of token ids into text deltas.

Decoding one token at a time is wrong for most tokenizers: a character can be
split over several byte tokens (``<0xE4><0xBD><0xA0>`` or byte-level BPE
pieces), and sentencepiece-style decoders drop the leading space of the *first*
token of whatever they are given. So each step decodes a short window of ids
that starts a few tokens back, and the new text is what that window's text has
beyond the text of the window without the new ids (the "prefix"/"read" offset
technique). While the window's text ends in U+FFFD, a character is still
incomplete: nothing is emitted until a later token completes it.

Contract: the concatenated deltas (plus :meth:`flush` at the end) equal
``decode(prompt + output)[len(decode(prompt)):]`` whenever that full decode
holds no U+FFFD; with invalid UTF-8 in the output the text stays sensible but
follows the window, not the whole sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# Tokens of context decoded in front of the first new token. A handful covers
# any character (at most 4 byte tokens) plus a token that carries a space.
INITIAL_WINDOW = 5
# How far a window may be widened to find a start that decodes to
# clean, non-empty text (see _anchor); bounds the work on odd prompts.
MAX_ANCHOR_TOKENS = 32

REPLACEMENT_CHAR = "\ufffd"


def make_decode_fn(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """The fastest call that decodes exactly like ``tokenizer.decode``.

    A fast tokenizer's Rust backend decodes in about half the time of the
    transformers wrapper; the wrapper is only needed when it post-processes
    (``clean_up_tokenization_spaces``).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        decode = backend.decode
        return lambda ids: decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Text deltas for one request's output tokens, continuing its prompt."""

    __slots__ = ("_decode", "token_ids", "prompt_len", "prefix_offset", "read_offset", "prefix_text")

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._decode = make_decode_fn(tokenizer, skip_special_tokens)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.prompt_len = len(self.token_ids)
        # token_ids[prefix_offset:read_offset] decodes to prefix_text, all of
        # which has been emitted already (or belongs to the prompt).
        self.read_offset = self.prompt_len
        self.prefix_offset = max(self.read_offset - INITIAL_WINDOW, 0)
        self.prefix_text = self._anchor()

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    def _anchor(self) -> str:
        """Move the window's start back until it decodes cleanly.

        The window must begin with visible text, because decoders strip a
        leading space only from the start of what they decode; and it must
        not begin inside a multi-byte character, whose stray bytes would
        decode to U+FFFD and, with byte fallback, spoil the bytes after them.
        """
        limit = max(self.prefix_offset - MAX_ANCHOR_TOKENS, 0)
        text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        while self.prefix_offset > limit and (not text or text[0] == REPLACEMENT_CHAR):
            self.prefix_offset -= 1
            text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        return text

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Append new tokens; return the text they complete (possibly "")."""
        self.token_ids.extend(new_token_ids)
        text = self._decode(self.token_ids[self.prefix_offset :])
        if text.endswith(REPLACEMENT_CHAR) or len(text) <= len(self.prefix_text):
            return ""  # an incomplete character, or nothing visible yet
        return self._advance(text)

    def flush(self) -> str:
        """Text still held back at the end of the request (an incomplete character).

        It is emitted as the tokenizer decodes it, U+FFFD included, so that the
        final text matches a full decode.
        """
        if self.read_offset == len(self.token_ids):
            return ""
        text = self._decode(self.token_ids[self.prefix_offset :])
        if len(text) <= len(self.prefix_text):
            return ""
        return self._advance(text)

    def _advance(self, text: str) -> str:
        delta = text[len(self.prefix_text) :]
        # The next window starts at the tokens just emitted: they end on a
        # character boundary and give the following tokens their context.
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.prefix_text = self._anchor()
        return delta
