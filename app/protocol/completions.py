"""/v1/completions: the request (prompts as text, token ids or embeddings, echo) and its response."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from app.errors import BadRequestError
from app.protocol.common import PromptLogprobs, UsageInfo
from app.protocol.sampling import MAX_N, REFUSED_COMMON, SamplingFields
from core.protocol import MAX_LOGPROBS

# Completions default to 16 tokens, as in OpenAI's API; chat to "as many as fit".
COMPLETION_DEFAULT_MAX_TOKENS = 16


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, a list of token ids, or a batch: a list of strings or of token-id lists.
    prompt: str | list[Any] | None = None
    # Or prompts as embeddings: base64 of a torch.save'd tensor (vLLM's extension), one or a list.
    prompt_embeds: str | list[str] | None = None
    max_tokens: int | None = None
    echo: bool = False
    logprobs: int | None = None
    add_special_tokens: bool = True
    suffix: str | None = None
    best_of: int | None = None

    implemented: ClassVar[frozenset[str]] = SamplingFields.implemented | {
        "prompt", "prompt_embeds", "max_tokens", "echo", "logprobs", "add_special_tokens",
    }
    refused: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {
        **REFUSED_COMMON,
        "suffix": ((None, ""), "there is no insertion mode"),
        "best_of": ((None, 1), "vLLM V1 dropped it; use n"),
    }

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise BadRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}.", "logprobs")
        if self.max_tokens is not None and self.max_tokens < (0 if self.echo else 1):
            raise BadRequestError(f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens")
        if self.n * self.batch_size() > MAX_N:
            raise BadRequestError(
                f"n times the number of prompts must be at most {MAX_N}, got {self.n} x {self.batch_size()}.", "n"
            )

    def batch_size(self) -> int:
        """How many prompts the request carries (a batch is a list of strings, token-id lists or embeddings)."""
        many = self.prompt_embeds if self.prompt_embeds is not None else self.prompt
        if isinstance(many, list) and many and not _is_token_ids(many):
            return len(many)
        return 1

    def prompt_embeds_given(self) -> bool:
        return self.prompt_embeds is not None

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token: asked for, or implied by echo with logprobs."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def prompt_embeds_list(self) -> list[str] | None:
        """The base64 prompt_embeds of this request (one per prompt), or None for text/token prompts."""
        embeds = self.prompt_embeds
        if embeds is None:
            return None
        if self.prompt not in (None, "", []):
            raise BadRequestError("Give either prompt or prompt_embeds, not both.", "prompt_embeds")
        embeds = [embeds] if isinstance(embeds, str) else embeds
        if not embeds:
            raise BadRequestError("prompt_embeds is empty.", "prompt_embeds")
        return embeds

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, each text or token ids: one, or a batch."""
        prompt = self.prompt
        if prompt is None:
            raise BadRequestError("Either prompt or prompt_embeds is required.", "prompt")
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise BadRequestError("The prompt is empty.", "prompt")
        if _is_token_ids(prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt) or all(_is_token_ids(p) for p in prompt):
            return list(prompt)
        raise BadRequestError(
            "prompt must be a string, a list of token ids, or a list of either (a batch).", "prompt"
        )


class CompletionLogprobs(msgspec.Struct):
    """OpenAI's legacy completions logprobs: one entry per token, in four parallel lists.

    The first prompt token of an echo has no logprob: null there and in
    ``top_logprobs``. ``text_offset`` is each token's position in the text.
    """

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(msgspec.Struct):
    """Both the whole response and each streamed chunk ("text_completion")."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: UsageInfo | None = None
