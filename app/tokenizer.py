"""The frontend's tokenizer, without transformers.

The frontend needs a tokenizer for four things: encode a prompt, decode
output tokens, know the special tokens, and render a chat template. A model
directory with a ``tokenizer.json`` has all of that in files that the
``tokenizers`` library (the Rust core of Hugging Face's fast tokenizers) and
jinja2 read directly, so the frontend loads neither transformers nor the
torch it imports: seconds off every start, with the same token ids, text and
rendered templates as transformers produces (tests/equivalence/test_tokenizer.py holds
the two side by side). A directory without ``tokenizer.json`` (a
sentencepiece model only) falls back to transformers' ``AutoTokenizer``.

What is read, as transformers (5.x) reads it: ``tokenizer.json`` (its
post-processor decides which special tokens an encoding gets),
``tokenizer_config.json`` (special tokens, ``clean_up_tokenization_spaces``,
``chat_template``), ``special_tokens_map.json``, and the chat template from
``chat_template.jinja`` or ``chat_template.json`` when present. Templates
render in a sandbox with transformers' settings: ``trim_blocks``,
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that
keeps non-ASCII text, and the ``raise_exception`` and ``strftime_now``
functions.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers

# transformers' clean_up_tokenization: spaces it removes before punctuation and contractions.
_CLEAN_UP = [(" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")]
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a local model directory (no network): ours when it has a
    ``tokenizer.json``, else transformers' ``AutoTokenizer``."""
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return Tokenizer.from_directory(path)
    from transformers import AutoTokenizer  # a slow (sentencepiece) tokenizer only

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _longest_first(lengths: list[int], room: int) -> list[int]:
    """The lengths a text (or a pair of texts) is cut to so that it fits ``room`` tokens, as the
    tokenizers library's ``longest_first`` strategy cuts them: only the longer one while the
    shorter fits in half, else half each (the odd token to the longer)."""
    if sum(lengths) <= room:
        return list(lengths)
    if len(lengths) == 1:
        return [room]
    first, second = lengths
    short, long = sorted((first, second))
    long = short if short > room else max(short, room - short)
    if short + long > room:
        short, long = room // 2, room // 2 + room % 2
    return [long, short] if first > second else [short, long]


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def _token_text(value: Any) -> str | None:
    """A special token as configured: a string, or a serialized AddedToken (a dict)."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _chat_template(path: str, config: dict[str, Any]) -> str | None:
    """The default chat template: from chat_template.jinja, chat_template.json or the config."""
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = _read_json(os.path.join(path, "chat_template.json")).get("chat_template", config.get("chat_template"))
    if isinstance(template, list):  # named templates: the one called "default"
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


_environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
)
_environment.filters["tojson"] = _tojson
_environment.globals["raise_exception"] = _raise_exception
_environment.globals["strftime_now"] = _strftime_now


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with its model directory's configuration, in
    the shape the frontend uses (a subset of transformers' tokenizer API)."""

    def __init__(self, backend: tokenizers.Tokenizer, config: dict[str, Any], name_or_path: str = "",
                 chat_template: str | None = None) -> None:
        self.backend_tokenizer = backend
        self.name_or_path = name_or_path
        self.chat_template = chat_template
        # transformers applies this WordPiece-era clean-up to BPE vocabularies only when forced.
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            not isinstance(backend.model, tokenizers.models.BPE)
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"))
        )
        for name in _SPECIAL:
            text = _token_text(config.get(name))
            setattr(self, name, text)
            setattr(self, f"{name}_id", backend.token_to_id(text) if text is not None else None)
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def from_directory(cls, path: str) -> Tokenizer:
        config = _read_json(os.path.join(path, "special_tokens_map.json"))
        config.update(_read_json(os.path.join(path, "tokenizer_config.json")))
        backend = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        return cls(backend, config, path, _chat_template(path, config))

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens as the post-processor of tokenizer.json adds them."""
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(
        self, text: str, pair: str | None = None, max_length: int | None = None
    ) -> tuple[list[int], list[int]]:
        """Token ids and segment ids (0: ``text``, 1: ``pair``) of a text or a sentence pair, with
        the special tokens the post-processor puts around and between them (BERT's [CLS] .. [SEP]
        .. [SEP]). With ``max_length`` the texts' tokens are cut at their ends, the longer one first,
        until the whole fits, special tokens included (transformers' ``longest_first``)."""
        backend = self.backend_tokenizer
        if max_length is None:
            encoding = backend.encode(text, pair, add_special_tokens=True)
            return encoding.ids, encoding.type_ids
        parts = [backend.encode(t, add_special_tokens=False) for t in (text, pair) if t is not None]
        room = max(max_length - backend.num_special_tokens_to_add(pair is not None), 0)
        lengths = _longest_first([len(p.ids) for p in parts], room)
        for part, length in zip(parts, lengths):
            part.truncate(length)
        encoding = backend.post_process(*parts, add_special_tokens=True)
        return encoding.ids, encoding.type_ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            for old, new in _CLEAN_UP:
                text = text.replace(old, new)
        return text

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render the conversation (jinja2 errors propagate); token ids unless ``tokenize=False``."""
        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            raise ValueError("this tokenizer has no chat template and none was given")
        template = self._compiled.get(source)
        if template is None:
            template = self._compiled[source] = _environment.from_string(source)
        special = {name: getattr(self, name) for name in _SPECIAL if getattr(self, name) is not None}
        text = template.render(
            messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
            **{**special, **kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text
