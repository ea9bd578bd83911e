"""Logprobs in the frontend: engine arrays to OpenAI's response shapes.

The engine sends, per token, the token and its top-k alternatives with
their log probabilities and the token's rank (``core.protocol.LogprobsArrays``).
Here they become plain lists (``Logprobs``, merged as deltas are), then
OpenAI's completions shape (tokens, token_logprobs, top_logprobs,
text_offset), its chat shape (token, logprob, bytes, top_logprobs) or vLLM's
``prompt_logprobs``.

A token is shown as the text it adds to the output in context (``TokenTexts``):
a sentencepiece piece with its word-boundary mark as a space, a byte-level
BPE token as the bytes it stands for. A token that is only part of a UTF-8
character (byte fallback, split byte-level pieces) is shown as its bytes,
``bytes:\\xe4``, as OpenAI does, and chat's ``bytes`` field always holds the
exact bytes, so the pieces of a character can be put back together.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from app.protocol.chat import ChatLogprobs, ChatTokenLogprob, TopLogprob
from app.protocol.common import PromptLogprob, PromptLogprobs
from app.protocol.completions import CompletionLogprobs
from core.protocol import LogprobsArrays

# JSON has no -inf; OpenAI and vLLM report impossible tokens with this.
MIN_LOGPROB = -9999.0
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPIECE_SPACE = "\u2581"


@dataclass(slots=True)
class Logprobs:
    """Entries of consecutive tokens: ``token_ids[i]`` is [token, alternatives...]
    with ``logprobs[i]`` alike, and ``ranks[i]`` the token's rank."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    @classmethod
    def from_arrays(cls, arrays: LogprobsArrays) -> Logprobs:
        return cls(arrays.token_ids.tolist(), arrays.logprobs.tolist(), arrays.ranks.tolist())

    def extend(self, later: Logprobs) -> None:
        self.token_ids.extend(later.token_ids)
        self.logprobs.extend(later.logprobs)
        self.ranks.extend(later.ranks)

    def __len__(self) -> int:
        return len(self.ranks)


class StepLogprobs:
    """One engine step's logprobs batch as lists, cut per request."""

    __slots__ = ("token_ids", "logprobs", "ranks")

    def __init__(self, arrays: LogprobsArrays) -> None:
        self.token_ids = arrays.token_ids.tolist()
        self.logprobs = arrays.logprobs.tolist()
        self.ranks = arrays.ranks.tolist()

    def entries(self, start: int, count: int, num_alternatives: int) -> Logprobs:
        """Rows start .. start + count, with the first ``num_alternatives`` alternatives."""
        stop, width = start + count, num_alternatives + 1
        return Logprobs(
            [row[:width] for row in self.token_ids[start:stop]],
            [row[:width] for row in self.logprobs[start:stop]],
            self.ranks[start:stop],
        )


def _clamp(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # also maps NaN, which compares False


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-printable-character table (byte-level BPE)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in table.items()}


class TokenTexts:
    """What each token id stands for, as bytes and as display text (cached per id)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._id_to_token = backend.id_to_token if backend is not None else self._slow_id_to_token
        decoder = _decoder_types(backend)
        self._byte_level = "ByteLevel" in decoder
        self._byte_fallback = "ByteFallback" in decoder or backend is None
        self._byte_decoder = _byte_decoder() if self._byte_level else {}
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        if backend is not None:
            self._special |= {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self._bytes: dict[int, bytes] = {}

    def _slow_id_to_token(self, token_id: int) -> str | None:
        tokens = self.tokenizer.convert_ids_to_tokens([token_id])
        return tokens[0] if tokens else None

    def bytes_of(self, token_id: int) -> bytes:
        cached = self._bytes.get(token_id)
        if cached is None:
            cached = self._bytes[token_id] = self._compute_bytes(token_id)
        return cached

    def _compute_bytes(self, token_id: int) -> bytes:
        piece = self._id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._special:
            return piece.encode()
        if self._byte_level:
            decoder = self._byte_decoder
            if all(c in decoder for c in piece):
                return bytes(decoder[c] for c in piece)
            return piece.encode()
        if self._byte_fallback and (match := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(match.group(1), 16)])
        return piece.replace(_SPIECE_SPACE, " ").encode()

    def text_of(self, token_id: int, as_token_id: bool = False) -> str:
        """The token as shown in logprobs; ``token_id:N`` with ``as_token_id`` (vLLM's option)."""
        if as_token_id:
            return f"token_id:{token_id}"
        raw = self.bytes_of(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _decoder_types(backend: Any) -> set[str]:
    """The component types of a fast tokenizer's decoder (empty when unknown)."""
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    if decoder is None:
        return set()
    try:
        spec = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return set()
    parts = spec.get("decoders", [spec]) if isinstance(spec, dict) else []
    return {part.get("type", "") for part in parts if isinstance(part, dict)}


def completion_logprobs(
    texts: TokenTexts,
    entries: Logprobs,
    num_alternatives: int,
    offset: int = 0,
    first_prompt_token: int | None = None,
    as_token_ids: bool = False,
) -> tuple[CompletionLogprobs, int]:
    """OpenAI's completions logprobs for ``entries``, the first token at text ``offset``.

    ``first_prompt_token`` (echo) comes first, with null logprobs. Each
    position's ``top_logprobs`` holds the token itself and its
    ``num_alternatives`` most likely alternatives. Returns the next offset.
    """
    out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])

    def add_token(token_id: int) -> str:
        nonlocal offset
        text = texts.text_of(token_id, as_token_ids)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        return text

    if first_prompt_token is not None:
        add_token(first_prompt_token)
        out.token_logprobs.append(None)
        out.top_logprobs.append(None)
    for ids, logprobs in zip(entries.token_ids, entries.logprobs):
        token = add_token(ids[0])
        out.token_logprobs.append(_clamp(logprobs[0]))
        top = {token: _clamp(logprobs[0])}
        for token_id, logprob in zip(ids[1 : num_alternatives + 1], logprobs[1 : num_alternatives + 1]):
            top.setdefault(texts.text_of(token_id, as_token_ids), _clamp(logprob))
        out.top_logprobs.append(top)
    return out, offset


def chat_logprobs(
    texts: TokenTexts, entries: Logprobs, num_alternatives: int, as_token_ids: bool = False
) -> ChatLogprobs:
    """OpenAI's chat logprobs: each token with its bytes and its top alternatives."""
    content = []
    for ids, logprobs in zip(entries.token_ids, entries.logprobs):
        top = [
            TopLogprob(texts.text_of(t, as_token_ids), _clamp(lp), list(texts.bytes_of(t)))
            for t, lp in zip(ids[1 : num_alternatives + 1], logprobs[1 : num_alternatives + 1])
        ]
        token = ids[0]
        content.append(
            ChatTokenLogprob(texts.text_of(token, as_token_ids), _clamp(logprobs[0]), list(texts.bytes_of(token)), top)
        )
    return ChatLogprobs(content=content)


def prompt_logprobs(texts: TokenTexts, entries: Logprobs | None) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then per token a
    dict from token id to its logprob, rank and text (the token and its alternatives)."""
    if entries is None:
        return None
    result: PromptLogprobs = [None]
    for ids, logprobs, rank in zip(entries.token_ids, entries.logprobs, entries.ranks):
        position = {ids[0]: PromptLogprob(_clamp(logprobs[0]), rank, texts.text_of(ids[0]))}
        for alt_rank, (token_id, logprob) in enumerate(zip(ids[1:], logprobs[1:]), start=1):
            position.setdefault(token_id, PromptLogprob(_clamp(logprob), alt_rank, texts.text_of(token_id)))
        result.append(position)
    return result
