"""Shapes every OpenAI endpoint shares: ids, timestamps, usage, prompt logprobs, /v1/models, /version."""

from __future__ import annotations

import time
import uuid

import msgspec


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class UsageInfo(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens),
        )


class PromptLogprob(msgspec.Struct):
    """One token of a prompt position, in vLLM's ``prompt_logprobs`` (keyed by token id)."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "ringllm"
    root: str | None = None
    parent: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class VersionResponse(msgspec.Struct):
    version: str
