"""From prompt (text, token ids or chat messages) to a validated EngineCoreRequest.

Everything that needs the tokenizer or can be rejected before the engine sees
the request happens here, in the frontend: the engine only gets token ids that
fit its context window.
"""

from __future__ import annotations

import base64
import io
import json
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jinja2
import msgspec

from app.tokenizer import load_tokenizer
from core.config import EngineConfig
from core.protocol import EngineCoreRequest, LoRARequest, PoolingParams, SamplingParams
from core.validation import ModelLimits, validate_request

if TYPE_CHECKING:
    import torch


def _generation_eos_ids(tokenizer: Any) -> list[int]:
    """End-of-sequence ids from generation_config.json (may list several)."""
    path = os.path.join(getattr(tokenizer, "name_or_path", "") or "", "generation_config.json")
    try:
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError):
        return []
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else [int(i) for i in eos]


def _chat_turn_stops(tokenizer: Any) -> list[str]:
    """Stop strings that end a turn of the model's own chat template.

    Read from ``ringllm.json`` beside the tokenizer (``{"chat_stop": [...]}``):
    a base model given a chat format by its template has no end-of-turn token
    to emit, so its template's turn delimiter has to be a stop string.
    """
    directory = getattr(tokenizer, "name_or_path", "") or ""
    if not os.path.isdir(directory):  # a tokenizer built in memory
        return []
    path = os.path.join(directory, "ringllm.json")
    try:
        with open(path, encoding="utf-8") as f:
            stops = json.load(f).get("chat_stop", [])
    except FileNotFoundError:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"{path}: chat_stop must be a list of non-empty strings")
    return stops


class InputProcessor:
    """Tokenizes prompts and checks requests against the model's limits."""

    def __init__(self, tokenizer: Any, limits: ModelLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.max_model_len = limits.max_model_len
        eos_ids = _generation_eos_ids(tokenizer)
        self.eos_token_id: int | None = tokenizer.eos_token_id
        if self.eos_token_id is None and eos_ids:
            self.eos_token_id = eos_ids[0]
        # Models such as Llama 3 end a turn with any of several tokens: the
        # ones besides eos_token_id become stop tokens.
        self.extra_eos_ids = [i for i in eos_ids if i != self.eos_token_id]
        # Added to chat requests rendered with the tokenizer's own template.
        self.chat_stop = _chat_turn_stops(tokenizer)

    @classmethod
    def from_config(cls, config: EngineConfig, tokenizer: Any | None = None) -> InputProcessor:
        """The processor for an engine config; loads its tokenizer unless given."""
        return cls(tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer), ModelLimits.from_config(config))

    # ------------------------------------------------------------- prompts

    def tokenize_prompt(self, prompt: str | Sequence[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt (with the tokenizer's BOS unless
        ``add_special_tokens`` is false), or the given ids (checked against the
        vocabulary by ``process``)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        ids = list(prompt)
        for token_id in ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool):
                raise ValueError(f"Token id {token_id!r} is not an integer.")
        return ids

    def tokenize_pair(
        self, text: str, pair: str | None = None, max_length: int | None = None
    ) -> tuple[list[int], list[int]]:
        """A text, or a sentence pair as a cross-encoder reads it: token ids and segment ids; with
        ``max_length``, the texts cut at their ends (the longer first) to fit it with their
        special tokens, as sentence-transformers truncates to ``max_seq_length``."""
        tokenizer = self.tokenizer
        if hasattr(tokenizer, "encode_pair"):
            return tokenizer.encode_pair(text, pair, max_length)
        # transformers' tokenizer (a directory without tokenizer.json)
        truncation = {"truncation": "longest_first", "max_length": max_length} if max_length else {}
        encoded = tokenizer(text, pair, **truncation)
        ids = list(encoded["input_ids"])
        return ids, list(encoded.get("token_type_ids") or [0] * len(ids))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        **template_kwargs: Any,
    ) -> list[int]:
        """Render the conversation with a chat template and tokenize it.

        ``chat_template`` overrides the tokenizer's own. The rendered text is
        tokenized without adding special tokens unless asked: templates write
        their own BOS.
        """
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "This model has no chat template and the request gave none: pass "
                "`chat_template` in the request or start the server with --chat-template, "
                "or use /v1/completions."
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **template_kwargs,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"The chat template failed to render the messages: {exc}") from exc
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """Each bad word as token ids, as it is tokenized on its own and after a space
        (vLLM's two variants; identical ones are kept once)."""
        result: list[list[int]] = []
        for word in words:
            variants = [self.tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False) for prefix in ("", " ")]
            if not any(variants):
                raise ValueError(f"The bad word {word!r} has no tokens.")
            result += [ids for i, ids in enumerate(variants) if ids and ids not in result and ids not in variants[:i]]
        return result

    def load_prompt_embeds(self, data: str) -> torch.Tensor:
        """A prompt given as embeddings: base64 of a ``torch.save``d float tensor
        [tokens, hidden] (a leading batch dimension of 1 is accepted), as vLLM takes it.
        Its shape and values are checked by ``process``.

        Loaded with ``weights_only=True``: tensors and plain containers only,
        never arbitrary pickled objects.
        """
        import torch  # only prompts given as embeddings need it in the frontend

        if not self.limits.enable_prompt_embeds:
            raise ValueError(
                "prompt_embeds are not enabled on this server: start it with --enable-prompt-embeds."
            )
        try:
            raw = base64.b64decode(data, validate=True)
            embeds = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
        except Exception as exc:  # noqa: BLE001 - any failure is the client's bad input
            raise ValueError(f"prompt_embeds is not a base64-encoded torch.save tensor: {exc}") from None
        if not isinstance(embeds, torch.Tensor):
            raise ValueError(f"prompt_embeds must hold one tensor, not {type(embeds).__name__}.")
        if embeds.dim() == 3 and embeds.shape[0] == 1:
            embeds = embeds[0]
        return embeds.detach().contiguous()

    # ------------------------------------------------------------ requests

    def default_max_tokens(self, prompt_len: int) -> int:
        """Room left in the context window after the prompt."""
        return self.max_model_len - prompt_len

    def process(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        prompt_embeds: torch.Tensor | None = None,
        data_parallel_rank: int | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> EngineCoreRequest:
        """Validate and build the request the engine runs; ValueError if it cannot.

        With ``prompt_embeds`` (from :meth:`load_prompt_embeds`), ``prompt_token_ids`` must be empty.
        """
        if self.extra_eos_ids and not params.ignore_eos:
            stop_ids = params.stop_token_ids + [
                i for i in self.extra_eos_ids if i not in params.stop_token_ids
            ]
            params = msgspec.structs.replace(params, stop_token_ids=stop_ids)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.time(),
            priority=priority,
            cache_salt=cache_salt,
            prompt_embeds=prompt_embeds,
            data_parallel_rank=data_parallel_rank,
            pooling_params=pooling_params,
            lora_request=lora_request,
        )
        validate_request(request, self.limits)
        return request
