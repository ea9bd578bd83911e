"""The engine's mutable view of one request, owned by the scheduler.

``EngineCoreRequest`` is what crossed the wire; ``Request`` adds what changes
while the request lives in the engine: its status, the tokens generated so
far, how many of its tokens are already in the KV cache, and the lifecycle
events not yet reported to the frontend.
"""

from __future__ import annotations

import enum
import hashlib
from typing import Protocol

import torch

from core.protocol import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreRequest,
    FinishReason,
    LoRARequest,
    PoolingParams,
    ReasoningParams,
    SamplingParams,
)
from core.structured.request import StructuredOutputRequest


class BlockHasher(Protocol):
    """Computes the prefix-cache hashes of a request's newly filled blocks
    (``core.kv.block_hash.RequestBlockHasher``)."""

    block_size: int

    def __call__(self, request: Request) -> list[bytes]: ...


class RequestStatus(enum.IntEnum):
    """Lifecycle states; every value after PREEMPTED is a finished state."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # its grammar is still compiling; the scheduler skips it
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # could not run (an invalid grammar)

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """One request inside the engine.

    ``all_token_ids`` is the prompt followed by every generated token; the
    scheduler's only job per request is to move ``num_computed_tokens`` (the
    tokens whose keys and values are in the KV cache, or scheduled to be) up
    to ``num_tokens + num_output_placeholders``.

    ``num_output_placeholders`` counts tokens that scheduled batches will
    sample but whose values the scheduler has not seen yet. It is 0 between
    steps in synchronous mode; with async scheduling the next batch is
    scheduled while the previous one runs, and the runner, which already
    holds the sampled token, feeds it in as the next decode's input.

    ``block_hashes`` holds the prefix-cache hash of every full block of
    ``all_token_ids`` (empty when prefix caching is off), extended as tokens
    are appended.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float = 0.0,
        priority: int = 0,
        client_index: int = 0,
        cache_salt: str | None = None,
        prompt_embeds: torch.Tensor | None = None,
        block_hasher: BlockHasher | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.client_index = client_index
        self.cache_salt = cache_salt
        # A prompt given as embeddings: prompt_token_ids are placeholders that
        # only count positions; the model reads these rows instead.
        self.prompt_embeds = prompt_embeds
        # A pooling request: it finishes with its pooled output once its prompt has run.
        self.pooling_params = pooling_params
        # The LoRA adapter it runs with (None: the base model).
        self.lora_request = lora_request
        self.lora_int_id = lora_request.lora_int_id if lora_request is not None else 0

        self.status = RequestStatus.WAITING
        self.num_prompt_tokens = len(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache when first scheduled.
        self.num_cached_tokens = 0
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_output_placeholders = 0
        # Draft tokens proposed for the step after the next one's sample (speculative
        # decoding): scheduled after the known tokens, verified, and forgotten.
        self.spec_token_ids: list[int] = []
        # step_id of the first SchedulerOutput created after the last
        # preemption: tokens from earlier batches (still in flight when it was
        # preempted) belong to a computation that was thrown away.
        self.preempted_at_step = 0
        # Lifecycle events not yet handed to the frontend.
        self.events: list[EngineCoreEvent] = []
        self.block_hasher: BlockHasher | None = None
        self.block_hashes: list[bytes] = []
        # Its grammar and matcher when it has structured outputs (set by the engine).
        self.structured: StructuredOutputRequest | None = None
        # While its output is inside the model's reasoning and that matters (a grammar waits
        # for its end, or a budget caps it): its ReasoningParams; None once the end token is
        # among the output tokens (set by the engine; core/structured/reasoning.py).
        self.reasoning: ReasoningParams | None = None
        if block_hasher is not None:
            self.set_block_hasher(block_hasher)

    @classmethod
    def from_engine_core_request(
        cls, request: EngineCoreRequest, block_hasher: BlockHasher | None = None
    ) -> Request:
        prompt_token_ids, cache_salt, embeds = request.prompt_token_ids, request.cache_salt, None
        if request.prompt_embeds is not None:
            # Own the tensor: the decoded one may be a view of the transport's
            # shared pool, which is handed back once it is garbage collected.
            embeds = request.prompt_embeds.clone()
            prompt_token_ids = [0] * embeds.shape[0]
            # Placeholder ids are all alike, so the embeddings themselves must
            # key the prefix cache: fold their digest into the salt, which is
            # part of every block hash.
            digest = hashlib.sha256(embeds.contiguous().view(torch.uint8).cpu().numpy()).hexdigest()
            cache_salt = f"{cache_salt or ''}|prompt_embeds:{digest}"
        if request.lora_request is not None:
            # The same tokens under another adapter have other keys and values: the adapter
            # keys the prefix cache too (its number, which a reloaded adapter does not reuse).
            cache_salt = f"{cache_salt or ''}|lora:{request.lora_request.lora_int_id}"
        return cls(
            request_id=request.request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            priority=request.priority,
            client_index=request.client_index,
            cache_salt=cache_salt,
            prompt_embeds=embeds,
            block_hasher=block_hasher,
            pooling_params=request.pooling_params,
            lora_request=request.lora_request,
        )

    def set_block_hasher(self, block_hasher: BlockHasher) -> None:
        """Start hashing full blocks (the prompt's now, later ones as they fill)."""
        self.block_hasher = block_hasher
        self.block_hashes = []
        self.block_hashes.extend(block_hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            self.output_token_ids.extend(token_ids)
            self.all_token_ids.extend(token_ids)
        hasher = self.block_hasher
        # Cheap test first: a block fills once every block_size tokens.
        if hasher is not None and len(self.all_token_ids) >= (len(self.block_hashes) + 1) * hasher.block_size:
            self.block_hashes.extend(hasher(self))

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def record_event(self, event_type: EngineCoreEventType) -> None:
        self.events.append(EngineCoreEvent.new(event_type))

    def take_events(self) -> list[EngineCoreEvent] | None:
        """Hand over the pending events (None when there are none) and forget them."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
