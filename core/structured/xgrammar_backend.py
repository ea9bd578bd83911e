"""Everything that touches xgrammar: tokenizer info, compilation, matchers, the mask.

Imported by the engine on the first structured request only, so that neither
start-up nor the requests that do not use it pay for it. The frontend never
imports it. xgrammar itself imports transformers, for the isinstance checks of
``TokenizerInfo.from_huggingface``; this backend makes its tokenizer info from
``tokenizer.json`` instead, so xgrammar is imported without transformers where
nothing else has loaded it (``_import_xgrammar``): most of a second of the first
structured request, and its modules' memory in the engine.
"""

from __future__ import annotations

import json
import os
import sys
import types
from typing import Any

import msgspec
import torch

from core.model_config import ModelConfig
from core.structured.request import GrammarKey


def _import_xgrammar() -> types.ModuleType:
    """xgrammar, imported with a stand-in for transformers unless transformers is loaded already.
    xgrammar (pinned) takes three classes from it: two tokenizer bases for from_huggingface's
    checks and the base of its generate() logits processor, neither used here. The stand-in's
    classes have no instances, so from_huggingface would refuse any tokenizer; it leaves
    sys.modules once xgrammar is in, and a later ``import transformers`` loads the real one."""
    if "xgrammar" in sys.modules or "transformers" in sys.modules:
        import xgrammar

        return xgrammar
    stand_in = types.ModuleType("transformers", "stands in while xgrammar is imported (core/structured)")

    class NotLoaded:
        """transformers' tokenizer base classes, never loaded in this process."""

    for name in ("PreTrainedTokenizerBase", "PreTrainedTokenizerFast", "LogitsProcessor"):
        setattr(stand_in, name, NotLoaded)
    sys.modules["transformers"] = stand_in
    try:
        import xgrammar
    finally:
        if sys.modules.get("transformers") is stand_in:
            del sys.modules["transformers"]
    return xgrammar


xgr = _import_xgrammar()

# json_object: any JSON object.
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar (0.2.8) writes the characters of a length-bounded string (minLength, maxLength) as the
# first class below, which lets raw control characters through (a JSON parser then rejects the
# output); its unbounded strings use the second, as JSON requires. Schemas are compiled through
# their grammar's text with the class narrowed.
_LOOSE_STRING_CHARACTER = r"[^\"\\\r\n]"
_JSON_STRING_CHARACTER = r"[^\0-\x1f\"\\\r\n]"


class _AddedToken(msgspec.Struct):
    id: int
    content: str
    special: bool = False


class _TokenizerModel(msgspec.Struct):
    # BPE and WordPiece: token -> id; Unigram: [token, score] pairs in id order.
    vocab: dict[str, int] | list[tuple[str, float]]


class _TokenizerFile(msgspec.Struct):
    """What tokenizer_info reads of a ``tokenizer.json`` (the tokenizers library's format)."""

    model: _TokenizerModel
    added_tokens: list[_AddedToken] = []


def _vocabulary(doc: _TokenizerFile) -> dict[str, int]:
    """Token -> id over the model's vocabulary and the added tokens (tokenizers' get_vocab with
    its added tokens), read with one C parse instead of building the tokenizer (its merges
    included) only to list them."""
    vocab = doc.model.vocab
    tokens = dict(vocab) if isinstance(vocab, dict) else {token: i for i, (token, _score) in enumerate(vocab)}
    for token in doc.added_tokens:
        tokens[token.content] = token.id
    return tokens


def tokenizer_info(tokenizer_dir: str, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, from ``tokenizer.json`` (no transformers tokenizer).

    The vocabulary is padded to the model's ``vocab_size`` (its logits' width;
    the extra rows are never allowed). Special tokens get an empty string, so
    that no grammar ever takes ``<s>`` for the three characters it prints as;
    the stop tokens are allowed where the grammar may end.
    """
    path = os.path.join(tokenizer_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"structured outputs need a tokenizer.json in {tokenizer_dir}")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    doc = msgspec.json.decode(text, type=_TokenizerFile)
    vocab = _vocabulary(doc)
    size = max(vocab_size, max(vocab.values()) + 1)
    encoded = [""] * size
    for token, index in vocab.items():
        encoded[index] = token
    for token in doc.added_tokens:
        if token.special:
            encoded[token.id] = ""
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(text)  # noqa: SLF001 - pinned xgrammar
    return xgr.TokenizerInfo(
        encoded[:vocab_size] if size > vocab_size else encoded,
        metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids,
        add_prefix_space=metadata["add_prefix_space"],
    )


def _json_schema_grammar(schema: str, whitespace: dict[str, Any]) -> xgr.Grammar:
    """The schema's grammar, its strings' characters all valid JSON (see _LOOSE_STRING_CHARACTER)."""
    grammar = xgr.Grammar.from_json_schema(schema, **whitespace)
    text = str(grammar)
    if _LOOSE_STRING_CHARACTER not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHARACTER, _JSON_STRING_CHARACTER))


def _choice_grammar(choices: list[str]) -> str:
    """EBNF for "exactly one of these strings" (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XgrammarBackend:
    """Compiles StructuredOutputsParams specs and makes matchers and bitmasks."""

    def __init__(self, tokenizer_dir: str, model_config: ModelConfig, max_threads: int = 1) -> None:
        self.vocab_size = model_config.vocab_size
        self.info = tokenizer_info(tokenizer_dir, self.vocab_size, list(model_config.eos_token_ids))
        # Our own cache keeps compiled grammars by spec; xgrammar's would hold them twice.
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=False)

    def compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        """Raises (ValueError, RuntimeError...) with xgrammar's message for an invalid spec."""
        c = self.compiler
        kind, spec = key.kind, key.spec
        if kind in ("json", "json_object"):
            if kind == "json":
                json.loads(spec)  # a clear message for text that is not JSON at all
            whitespace = {"any_whitespace": key.any_whitespace}
            if key.any_whitespace:
                whitespace["max_whitespace_cnt"] = key.max_whitespace
            return c.compile_grammar(_json_schema_grammar(spec if kind == "json" else _JSON_OBJECT_SCHEMA, whitespace))
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_grammar(_choice_grammar(json.loads(spec)))
        if kind == "grammar":
            # EBNF/GBNF says "::="; anything else is taken for Lark, as vLLM does.
            return c.compile_grammar(spec) if "::=" in spec else c.compile_lark(spec)
        if kind == "structural_tag":
            tag = json.loads(spec)
            if "structures" in tag:  # the older format: begin/schema/end items and triggers
                items = [
                    xgr.StructuralTagItem(
                        begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"]
                    )
                    for s in tag["structures"]
                ]
                return c.compile_structural_tag(items, tag["triggers"])
            return c.compile_structural_tag(spec)
        raise ValueError(f"unknown structured output kind {kind!r}")

    def matcher(self, compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled)

    def only_end_allowed(self, matcher: xgr.GrammarMatcher) -> bool:
        """Whether the grammar allows nothing more than ending (its stop tokens)."""
        if not matcher.is_completed():
            return False
        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(mask, 0)
        words = mask[0]
        for token in matcher.stop_token_ids:
            bit = 1 << token % 32
            words[token // 32] &= ~(bit - (1 << 32) if bit >= 1 << 31 else bit)  # as int32
        return not bool(words.any())

    def bitmask(
        self, matchers: list[Any], drafts: list[list[int]] | None = None, skips: list[int] | None = None
    ) -> torch.Tensor:
        """[rows, ceil(vocab / 32)] int32: bit t of a row allows token t. A row per matcher,
        or with ``drafts`` (speculative decoding) len(drafts[i]) + 1 rows for matcher i: its
        mask now, then after each of its drafts (which it must accept; it is rolled back).
        ``skips[i]`` rows allowing every token come first (the grammar does not apply yet)."""
        drafts = drafts or [[] for _ in matchers]
        skips = skips or [0] * len(matchers)
        mask = xgr.allocate_token_bitmask(sum(len(d) + 1 for d in drafts) + sum(skips), self.vocab_size)
        row = 0
        for matcher, tokens, skip in zip(matchers, drafts, skips):
            row += skip  # allocated all ones
            matcher.fill_next_token_bitmask(mask, row)
            row += 1
            for token_id in tokens:
                matcher.accept_token(token_id)
                matcher.fill_next_token_bitmask(mask, row)
                row += 1
            if tokens:
                matcher.rollback(len(tokens))
        return mask


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """-inf, in place, for every token that row ``rows[k]`` of ``logits`` may not take
    by row k of ``bitmask``. xgrammar indexes logits and bitmask alike, so a batch
    whose structured rows are not exactly its first rows gets a full-height mask
    (all ones elsewhere)."""
    n = logits.shape[0]
    if rows != list(range(len(rows))):
        full = torch.full((n, bitmask.shape[1]), -1, dtype=torch.int32)
        full[rows] = bitmask
        bitmask = full
    bitmask = bitmask.to(logits.device, non_blocking=True)
    vocab = logits.shape[-1]
    if logits.dtype != torch.float32 and logits.device.type == "cpu":
        masked = logits[: bitmask.shape[0]].float()  # xgrammar's CPU kernel is float32 only
        xgr.apply_token_bitmask_inplace(masked, bitmask, vocab_size=vocab, indices=rows)
        logits[: bitmask.shape[0]] = masked.to(logits.dtype)
        return
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
