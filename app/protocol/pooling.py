"""Pooling endpoints: OpenAI's /v1/embeddings, vLLM's /pooling and /score, Jina/Cohere's /rerank.

Request structs forbid unknown fields: a misspelt or unsupported option is a 400
naming it, never silently ignored.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

# OpenAI takes at most 2048 inputs per embeddings request; so do we (each is an engine request).
MAX_POOLING_INPUTS = 2048
ENCODING_FORMATS = ("float", "base64")


class PoolingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int) -> PoolingUsage:
        return cls(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)


T = TypeVar("T")


class ListResponse(msgspec.Struct, Generic[T]):
    """The shape of OpenAI's embeddings response, which /pooling and /score share."""

    id: str
    created: int
    model: str
    data: list[T]
    usage: PoolingUsage
    object: str = "list"


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``input``: a string, a list of strings, a list of token ids, or a list of such lists."""

    input: str | list[Any]
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extensions: special tokens around each input, unit-length vectors (model default),
    # the scheduler's priority.
    add_special_tokens: bool = True
    normalize: bool | None = None
    priority: int = 0
    # Cut each input to this many tokens (-1: the model's context length) instead of refusing it.
    truncate_prompt_tokens: int | None = None


class PoolingRequest(EmbeddingRequest, kw_only=True, forbid_unknown_fields=True):
    """vLLM's /pooling: the pooler's raw output (``task`` encode) or an embedding."""

    task: str = "encode"


class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


EmbeddingResponse = ListResponse[EmbeddingData]


class PoolingData(msgspec.Struct):
    index: int
    data: Any  # nested float lists (one per pooled token for ALL pooling), or base64
    object: str = "pooling"


PoolingResponse = ListResponse[PoolingData]


class ScoreRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's /score: ``text_1`` against ``text_2`` (one against many, or pairwise)."""

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    user: str | None = None
    priority: int = 0
    truncate_prompt_tokens: int | None = None


class ScoreData(msgspec.Struct):
    index: int
    score: float
    object: str = "score"


ScoreResponse = ListResponse[ScoreData]


class ClassificationRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's /classify: each input's class probabilities under a sequence classifier."""

    input: str | list[Any]
    model: str | None = None
    user: str | None = None
    priority: int = 0
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None


class ClassificationData(msgspec.Struct):
    index: int
    label: str  # the most probable class
    probs: list[float]
    num_classes: int
    object: str = "classification"


ClassificationResponse = ListResponse[ClassificationData]


class RerankRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Jina's and Cohere's /rerank: documents ordered by relevance to the query."""

    query: str
    documents: list[str]
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = True
    user: str | None = None
    priority: int = 0
    truncate_prompt_tokens: int | None = None


class RerankDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(msgspec.Struct):
    total_tokens: int


class RerankResponse(msgspec.Struct):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage
