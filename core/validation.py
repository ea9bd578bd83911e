"""The one check of a request against the model's limits, shared by both processes.

The frontend runs it to answer a bad request with a 400 before anything is
sent; the EngineCore runs it again on what arrives over the wire, because it
never trusts its input. One function means one set of rules and one set of
messages (written for API users: they end up in OpenAI error bodies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.config import EngineConfig
from core.protocol import POOLING_TASKS, EngineCoreRequest

if TYPE_CHECKING:
    import torch


class InvalidRequestError(ValueError):
    """A request that cannot run; ``param`` names the offending field, if one does."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against."""

    max_model_len: int
    vocab_size: int  # the embedding table's rows (often more than the tokenizer's vocabulary)
    hidden_size: int
    enable_prompt_embeds: bool = False
    # A pooling model's task (embed, classify); None: the model generates.
    pooling_task: str | None = None
    matryoshka: bool = False  # embeddings may be shortened (``dimensions``)
    labels: tuple[str, ...] = ()  # a classifier's class names

    @classmethod
    def from_config(cls, config: EngineConfig) -> ModelLimits:
        pooler = config.pooler_config
        return cls(
            max_model_len=config.max_model_len,
            vocab_size=config.model_config.vocab_size,
            hidden_size=config.model_config.hidden_size,
            enable_prompt_embeds=config.enable_prompt_embeds,
            pooling_task=None if pooler is None else pooler.task,
            matryoshka=config.model_config.matryoshka,
            labels=config.model_config.labels,
        )


def check_prompt_embeds(embeds: torch.Tensor, limits: ModelLimits) -> None:
    """A prompt given as embeddings: allowed, [tokens, hidden_size], finite floats."""
    if not limits.enable_prompt_embeds:
        raise InvalidRequestError(
            "prompt_embeds are not enabled on this server: start it with --enable-prompt-embeds.", "prompt_embeds"
        )
    if embeds.dim() != 2 or embeds.shape[1] != limits.hidden_size:
        raise InvalidRequestError(
            f"prompt_embeds must have shape [tokens, {limits.hidden_size}], got {list(embeds.shape)}.", "prompt_embeds"
        )
    if not embeds.is_floating_point() or not bool(embeds.isfinite().all()):
        raise InvalidRequestError("prompt_embeds must hold finite floating-point numbers.", "prompt_embeds")


def validate_request(request: EngineCoreRequest, limits: ModelLimits) -> None:
    """Raise InvalidRequestError (a ValueError) saying what is wrong with ``request``, if anything."""
    embeds = request.prompt_embeds
    if embeds is not None:
        if request.prompt_token_ids:
            raise InvalidRequestError("Give a prompt or prompt_embeds, not both.", "prompt_embeds")
        check_prompt_embeds(embeds, limits)
    elif request.prompt_token_ids:
        ids = request.prompt_token_ids
        if min(ids) < 0 or max(ids) >= limits.vocab_size:
            bad = next(t for t in ids if not 0 <= t < limits.vocab_size)
            raise InvalidRequestError(f"Token id {bad} is out of vocabulary (size {limits.vocab_size}).", "prompt")
    prompt_len = request.num_prompt_tokens
    if prompt_len == 0:
        raise InvalidRequestError("The prompt is empty: it must contain at least one token.", "prompt")
    max_len = limits.max_model_len
    if request.pooling_params is not None or limits.pooling_task is not None:
        _validate_pooling(request, limits)
        return
    if prompt_len >= max_len:
        raise ValueError(
            f"This model's maximum context length is {max_len} tokens. However, your prompt has "
            f"{prompt_len} tokens, which leaves no room for the completion. Please reduce the length "
            "of the prompt."
        )
    params = request.sampling_params
    if prompt_len + params.max_tokens > max_len:
        raise ValueError(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the prompt, {params.max_tokens} "
            "in the completion). Please reduce the length of the prompt or of the completion."
        )
    try:
        params.validate()
    except ValueError as exc:
        raise InvalidRequestError(str(exc), _param_named_in(str(exc))) from None
    for param, token_ids in params.token_ids_to_check().items():
        for token_id in token_ids:
            if not 0 <= token_id < limits.vocab_size:
                raise InvalidRequestError(
                    f"Token id {token_id} in {param} is out of vocabulary (size {limits.vocab_size}).", param
                )
    if params.prompt_logprobs is not None and embeds is not None:
        raise InvalidRequestError(
            "prompt_logprobs are not available for a prompt given as embeddings: it has no token ids.",
            "prompt_logprobs",
        )


def _validate_pooling(request: EngineCoreRequest, limits: ModelLimits) -> None:
    """A pooling request to a pooling model: its prompt fits whole, its parameters fit the model."""
    params = request.pooling_params
    if params is None:
        raise InvalidRequestError(
            "This model is a pooling model (embeddings, scores): it generates no text.", "model"
        )
    if limits.pooling_task is None:
        raise InvalidRequestError("This model generates text; it serves no embeddings or scores.", "model")
    if request.prompt_embeds is not None:
        raise InvalidRequestError("A pooling request takes token ids, not prompt_embeds.", "prompt_embeds")
    prompt_len, max_len = request.num_prompt_tokens, limits.max_model_len
    if prompt_len > max_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_len} tokens. However, an input has "
            f"{prompt_len} tokens. Please reduce the length of the input.", "input"
        )
    if params.task not in POOLING_TASKS:
        raise InvalidRequestError(f"Unknown pooling task {params.task!r}.", "task")
    if params.task == "classify" and limits.pooling_task != "classify":
        raise InvalidRequestError("This model has no classification head: it serves embeddings.", "model")
    if params.task == "embed" and limits.pooling_task != "embed":
        raise InvalidRequestError("This model is a classifier (scores, rerank): it serves no embeddings.", "model")
    if params.dimensions is not None:
        if not limits.matryoshka:
            raise InvalidRequestError(
                "This model does not support Matryoshka embeddings: dimensions cannot be set.", "dimensions"
            )
        if not 1 <= params.dimensions <= limits.hidden_size:
            raise InvalidRequestError(
                f"dimensions must be in [1, {limits.hidden_size}], got {params.dimensions}.", "dimensions"
            )
    types = params.token_type_ids
    if types is not None and (len(types) != prompt_len or any(t not in (0, 1) for t in types)):
        raise InvalidRequestError("token_type_ids must give 0 or 1 for every prompt token.", "token_type_ids")


def _param_named_in(message: str) -> str | None:
    """The parameter a SamplingParams.validate message is about (its first word)."""
    first = message.split(" ", 1)[0]
    return first if first.isidentifier() and first.islower() else None
