"""Pooling routes: /v1/embeddings, /pooling, /score and /rerank.

Each input of an API request becomes one pooling engine request (``{id}-{i}``),
all sent at once so the scheduler batches them; the engine finishes each with
its pooled tensor, which arrives here as a numpy array. Scores come from the
model's classification head on each (query, document) pair when the model is
a cross-encoder, and are the cosine similarity of the two embeddings when it
embeds (as vLLM scores with an embedding model).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
from starlette.responses import Response

from app.choices import Choice
from app.errors import BadRequestError, InternalServerError
from app.output_processor import RequestOutput
from app.protocol.common import now, random_id
from app.protocol.pooling import (
    ENCODING_FORMATS,
    MAX_POOLING_INPUTS,
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from app.serving.base import (
    Admit,
    OpenAIServing,
    decode_request,
    json_response,
)
from core.protocol import PoolingParams, SamplingParams

# A pooling request samples nothing; one token keeps the engine's generation bookkeeping idle.
_NO_SAMPLING = SamplingParams(max_tokens=1)
Prompt = tuple[list[int], list[int] | None]  # token ids, and segment ids of a sentence pair


def _encoded(values: np.ndarray, encoding_format: str) -> Any:
    """Floats as JSON lists, or OpenAI's base64: the little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(values, dtype="<f4").tobytes()).decode()
    return values.tolist()


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class OpenAIServingPooling(OpenAIServing):
    @property
    def task(self) -> str | None:
        """The model's pooling task: embed, classify; None for a generative model."""
        return self.input_processor.limits.pooling_task

    # ------------------------------------------------------------- routes

    async def create_embedding(self, body: bytes, admit: Admit | None = None) -> Response:
        req: EmbeddingRequest = decode_request(body, EmbeddingRequest)
        self._check_request(req.model, "embeddings", "embed")
        self._check_format(req.encoding_format)
        request_id = random_id("embd")
        params = PoolingParams(task="embed", dimensions=req.dimensions, normalize=req.normalize)
        prompts = self._input_ids(req.input, req.add_special_tokens, self._truncation(req.truncate_prompt_tokens))
        outputs = await self._pool(request_id, prompts, params, req.priority, admit)
        data = [EmbeddingData(i, _encoded(out.pooled, req.encoding_format)) for i, out in enumerate(outputs)]
        return json_response(
            EmbeddingResponse(request_id, now(), self.served_model_name, data, self._usage(outputs))
        )

    async def create_pooling(self, body: bytes, admit: Admit | None = None) -> Response:
        req: PoolingRequest = decode_request(body, PoolingRequest)
        if req.task not in ("encode", "embed"):
            raise BadRequestError(f"task must be encode or embed, got {req.task!r}.", "task")
        self._check_request(req.model, "pooling", None)
        self._check_format(req.encoding_format)
        if req.task == "embed" and self.task != "embed":
            raise BadRequestError("This model is a classifier: it serves no embeddings.", "task")
        request_id = random_id("pool")
        params = PoolingParams(task=req.task, dimensions=req.dimensions, normalize=req.normalize)
        prompts = self._input_ids(req.input, req.add_special_tokens, self._truncation(req.truncate_prompt_tokens))
        outputs = await self._pool(request_id, prompts, params, req.priority, admit)
        data = [PoolingData(i, _encoded(out.pooled, req.encoding_format)) for i, out in enumerate(outputs)]
        return json_response(PoolingResponse(request_id, now(), self.served_model_name, data, self._usage(outputs)))

    async def create_classification(self, body: bytes, admit: Admit | None = None) -> Response:
        req: ClassificationRequest = decode_request(body, ClassificationRequest)
        self._check_request(req.model, "classify", None)
        if self.task != "classify":
            raise BadRequestError("This model embeds: it has no classification head to classify with.", "model")
        request_id = random_id("classify")
        prompts = self._input_ids(req.input, req.add_special_tokens, self._truncation(req.truncate_prompt_tokens))
        # Probabilities over the classes: softmax, whatever the number of labels.
        params = PoolingParams(task="classify", use_activation=False)
        outputs = await self._pool(request_id, prompts, params, req.priority, admit)
        labels = self.engine.input_processor.limits.labels
        data = []
        for i, out in enumerate(outputs):
            logits = out.pooled.astype(np.float64)
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            best = int(probs.argmax())
            label = labels[best] if best < len(labels) else str(best)
            data.append(ClassificationData(i, label, probs.tolist(), probs.size))
        return json_response(
            ClassificationResponse(request_id, now(), self.served_model_name, data, self._usage(outputs))
        )

    async def create_score(self, body: bytes, admit: Admit | None = None) -> Response:
        req: ScoreRequest = decode_request(body, ScoreRequest)
        self._check_request(req.model, "score", None)
        firsts = [req.text_1] if isinstance(req.text_1, str) else req.text_1
        seconds = [req.text_2] if isinstance(req.text_2, str) else req.text_2
        if not firsts or not seconds:
            raise BadRequestError("text_1 and text_2 must not be empty.", "text_1" if not firsts else "text_2")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        elif len(firsts) != len(seconds):
            raise BadRequestError(
                f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or as many as text_2.",
                "text_2",
            )
        request_id = random_id("score")
        truncation = self._truncation(req.truncate_prompt_tokens)
        scores, usage = await self._scores(request_id, firsts, seconds, req.priority, admit, truncation)
        data = [ScoreData(i, s) for i, s in enumerate(scores)]
        return json_response(ScoreResponse(request_id, now(), self.served_model_name, data, usage))

    async def create_rerank(self, body: bytes, admit: Admit | None = None) -> Response:
        req: RerankRequest = decode_request(body, RerankRequest)
        self._check_request(req.model, "rerank", None)
        if not req.documents:
            raise BadRequestError("documents must not be empty.", "documents")
        if req.top_n is not None and req.top_n < 1:
            raise BadRequestError(f"top_n must be at least 1, got {req.top_n}.", "top_n")
        request_id = random_id("rerank")
        scores, usage = await self._scores(
            request_id, [req.query] * len(req.documents), req.documents, req.priority, admit,
            self._truncation(req.truncate_prompt_tokens),
        )
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n]
        results = [
            RerankResult(i, scores[i], RerankDocument(req.documents[i]) if req.return_documents else None)
            for i in order
        ]
        return json_response(
            RerankResponse(request_id, self.served_model_name, results, RerankUsage(usage.total_tokens))
        )

    # ------------------------------------------------------------- helpers

    def _check_request(self, model: str | None, route: str, task: str | None) -> None:
        """The model exists, serves pooling, and (``task``) this route's task."""
        self._check_model(model)
        self._check_alive()
        if self.task is None:
            raise BadRequestError(
                f"This model generates text; /{route} needs a pooling model (start the server with --runner pooling).",
                "model",
            )
        if task == "embed" and self.task != "embed":
            raise BadRequestError(
                "This model is a classifier (use /score or /rerank): it serves no embeddings.", "model"
            )

    @staticmethod
    def _check_format(encoding_format: str) -> None:
        if encoding_format not in ENCODING_FORMATS:
            raise BadRequestError(
                f"encoding_format must be float or base64, got {encoding_format!r}.", "encoding_format"
            )

    def _truncation(self, tokens: int | None) -> int | None:
        """``truncate_prompt_tokens`` checked: None, or how many tokens an input keeps (-1: the context)."""
        if tokens is None:
            return None
        if tokens == -1:
            return self.max_model_len
        if not 1 <= tokens <= self.max_model_len:
            raise BadRequestError(
                f"truncate_prompt_tokens must be -1 or in [1, {self.max_model_len}], got {tokens}.",
                "truncate_prompt_tokens",
            )
        return tokens

    def _input_ids(self, value: str | list[Any], add_special_tokens: bool, truncation: int | None) -> list[Prompt]:
        """Each input's token ids: a string, a list of strings, token ids, or lists of token ids. With
        ``truncation``, a text keeps its special tokens and loses its last tokens (as sentence-transformers
        cuts to max_seq_length); token ids given as such lose theirs."""
        if isinstance(value, str):
            items: list[Any] = [value]
        elif _is_ids(value) and value:
            items = [value]
        else:
            items = value
        if not items:
            raise BadRequestError("input must not be empty.", "input")
        if len(items) > MAX_POOLING_INPUTS:
            raise BadRequestError(
                f"input holds {len(items)} items; at most {MAX_POOLING_INPUTS} are taken per request.", "input"
            )
        result: list[Prompt] = []
        processor = self.input_processor
        for item in items:
            if isinstance(item, str):
                if add_special_tokens:
                    result.append((processor.tokenize_pair(item, None, truncation)[0], None))
                else:
                    result.append((processor.tokenize_prompt(item, add_special_tokens)[:truncation], None))
            elif _is_ids(item):
                if not item:
                    raise BadRequestError("An input's token list is empty.", "input")
                result.append((list(item)[:truncation], None))
            else:
                raise BadRequestError(
                    "input must be a string, a list of strings, a list of token ids or a list of token-id lists.",
                    "input",
                )
        return result

    async def _scores(
        self, request_id: str, firsts: Sequence[str], seconds: Sequence[str], priority: int, admit: Admit | None,
        truncation: int | None = None,
    ) -> tuple[list[float], PoolingUsage]:
        """One score per (first, second) pair, and the tokens they took."""
        if len(firsts) > MAX_POOLING_INPUTS:
            raise BadRequestError(f"At most {MAX_POOLING_INPUTS} pairs are scored per request.", "text_2")
        processor = self.input_processor
        if self.task == "classify":
            prompts: list[Prompt] = [processor.tokenize_pair(a, b, truncation) for a, b in zip(firsts, seconds)]
            outputs = await self._pool(request_id, prompts, PoolingParams(task="classify"), priority, admit)
            for out in outputs:
                if out.pooled.size != 1:
                    raise BadRequestError(
                        f"This classifier has {out.pooled.size} labels; scores need a model with one.", "model"
                    )
            return [float(out.pooled[0]) for out in outputs], self._usage(outputs)
        # An embedding model: the cosine similarity of the two texts' (unit) embeddings.
        texts = list(dict.fromkeys([*firsts, *seconds]))
        prompts = [(processor.tokenize_pair(t, None, truncation)[0], None) for t in texts]
        outputs = await self._pool(request_id, prompts, PoolingParams(task="embed", normalize=True), priority, admit)
        vectors = {t: out.pooled for t, out in zip(texts, outputs)}
        return [float(np.dot(vectors[a], vectors[b])) for a, b in zip(firsts, seconds)], self._usage(outputs)

    async def _pool(
        self, request_id: str, prompts: list[Prompt], params: PoolingParams, priority: int, admit: Admit | None
    ) -> list[RequestOutput]:
        """Every prompt through the engine at once; their outputs in input order."""
        choices = []
        for i, (ids, types) in enumerate(prompts):
            p = params if types is None else msgspec.structs.replace(params, token_type_ids=types)
            try:
                request = self.input_processor.process(
                    f"{request_id}-{i}", ids, _NO_SAMPLING, priority, pooling_params=p
                )
            except ValueError as exc:
                param = "input" if getattr(exc, "param", None) == "prompt" else getattr(exc, "param", None)
                raise BadRequestError(f"Input {i}: {exc}" if len(prompts) > 1 else str(exc), param) from None
            choices.append(Choice(i, i, request))
        if admit is not None:
            admit(len(choices))
        outputs = await self._collect_all(choices)
        for out in outputs:
            if out.pooled is None:
                raise InternalServerError("The engine finished an input without its pooled output.")
        return outputs

    @staticmethod
    def _usage(outputs: list[RequestOutput]) -> PoolingUsage:
        return PoolingUsage.of(sum(out.num_prompt_tokens for out in outputs))
