"""What the scheduler hands the model runner each step, and what comes back.

The runner keeps a persistent batch, so the scheduler sends deltas: full data
for requests the runner has not seen (new or resumed after preemption), and
only the new blocks and computed-token counts for the ones it already holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from core.protocol import LogprobsArrays, PoolingParams, SamplingParams


@dataclass
class NewRequestData:
    """A request the runner must (re)create: new, or resumed after preemption.

    ``token_ids`` is every token known so far (prompt, plus the outputs of a
    resumed request), ``block_ids`` its whole block table in each KV cache group
    (core/kv/kv_groups.py; one group for most models).
    """

    req_id: str
    token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]
    num_computed_tokens: int
    # The prompt as embeddings [num_prompt_tokens, hidden] (token_ids then
    # start with that many placeholders).
    prompt_embeds: torch.Tensor | None = None
    # token_ids[:num_prompt_tokens] is the prompt (None: all of token_ids).
    # Penalties and prompt logprobs tell prompt from output by it; min_tokens
    # holds back eos_token_id.
    num_prompt_tokens: int | None = None
    eos_token_id: int | None = None
    pooling_params: PoolingParams | None = None  # a pooling request: pooled, never sampled
    lora_int_id: int = 0  # its LoRA adapter (0: the base model)


@dataclass
class CachedRequestData:
    """Deltas for requests the runner already holds, index-aligned lists."""

    req_ids: list[str] = field(default_factory=list)
    # Blocks appended to the request's table in each KV cache group this step (empty when none).
    new_block_ids: list[Sequence[Sequence[int]]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> number of tokens to compute this step (prefill chunk or 1 for decode).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that finished (or were aborted) since the last step: drop them.
    finished_req_ids: set[str]
    # Requests preempted this step: drop their state; they come back as new.
    # (A request preempted and re-admitted in one step is in both; drop first.)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Sequence number of this output; the scheduler drops tokens sampled by a
    # batch scheduled before the request was last preempted (see Request).
    step_id: int = 0
    # Structured outputs: the requests of this step that sample under a grammar,
    # and their next-token bitmask (row i for grammar_req_ids[i], int32, a bit per
    # token: xgrammar's layout), which the runner applies to their logits.
    grammar_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: torch.Tensor | None = None
    # Reasoning budgets (core/structured/reasoning.py): (request, its nth row this step, token)
    # for each row whose token is forced; the runner masks every other token of that row.
    forced_token_ids: list[tuple[str, int, int]] = field(default_factory=list)
    # Speculative decoding: the draft tokens scheduled for verification, by request.
    # They follow the request's known tokens and are counted in num_scheduled_tokens;
    # the runner samples one more token than it was given drafts.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class DraftTokenIds:
    """The proposer's drafts after a step: ``draft_token_ids[i]`` for ``req_ids[i]``."""

    req_ids: list[str]
    draft_token_ids: list[list[int]]


@dataclass
class ModelRunnerOutput:
    """Sampled tokens per scheduled request, in the order of ``req_ids``.

    A request whose prefill chunk did not reach the end of its known tokens
    gets an empty list: nothing was sampled for it. A request that verified
    drafts gets the ones accepted and the token sampled after them. ``logprobs`` holds the
    sampled tokens' logprobs of the requests that asked, a row each:
    ``logprobs_rows`` (index-aligned with ``req_ids``) gives the row, or -1.
    ``prompt_logprobs`` (by request id) comes in the step that samples the
    request's first token. A pooling model's step gives ``pooler_output`` instead:
    per request, its pooled tensor when its prompt ended in this step, else None.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: LogprobsArrays | None = None
    logprobs_rows: list[int] | None = None
    prompt_logprobs: dict[str, LogprobsArrays] | None = None
    pooler_output: list[np.ndarray | None] | None = None

    @classmethod
    def for_requests(
        cls, req_ids: list[str], sampled_token_ids: list[list[int]], logprobs: LogprobsArrays | None = None,
        logprobs_rows: list[int] | None = None, prompt_logprobs: dict[str, LogprobsArrays] | None = None,
        pooler_output: list[np.ndarray | None] | None = None,
    ) -> ModelRunnerOutput:
        """The output of a step over ``req_ids``, with its index built."""
        return cls(
            req_ids, {r: i for i, r in enumerate(req_ids)}, sampled_token_ids, logprobs, logprobs_rows,
            prompt_logprobs, pooler_output,
        )


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
