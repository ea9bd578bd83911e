"""Sampling a step in which no request verifies drafts, and reporting its tokens.

Each request that reaches the end of its known tokens gets one logits row:
grammars mask it (a reasoning budget may force it), the sampler draws from it, and the token is appended to the
persistent batch. On a GPU the ids stay on the device (core/worker/async_output.py):
the batch gets placeholders, the next step reads its inputs from the device,
and the output is materialised when the engine reads it. (A step that
verifies drafts is sampled by core/spec_decode/speculator.py instead.)
"""

from __future__ import annotations

import numpy as np
import torch

from core.protocol import LogprobsArrays
from core.sched.output import ModelRunnerOutput, SchedulerOutput
from core.worker.async_output import (
    PLACEHOLDER_TOKEN_ID,
    AsyncModelRunnerOutput,
    DeferredTokens,
    SampledTokens,
)
from core.worker.input_batch import InputBatch
from core.worker.prompt_logprobs import PromptLogprobs
from core.worker.sampler import Sampler
from core.worker.staging import Staged, apply_grammar, force_tokens


class StepSampler:
    """What a step without drafts does with its logits rows (the runner holds one)."""

    def __init__(
        self, sampler: Sampler, batch: InputBatch, prompt_logprobs: PromptLogprobs, deferred: DeferredTokens,
        defer: bool, copy_stream: torch.cuda.Stream | None,
    ) -> None:
        self.sampler = sampler
        self.batch = batch
        self.prompt_logprobs = prompt_logprobs
        self.deferred = deferred
        self.defer = defer  # sampled ids reach the batch as placeholders (the GPU's path)
        self.copy_stream = copy_stream  # where their copy to the host runs

    def __call__(
        self, so: SchedulerOutput, staged: Staged, sample_rows: np.ndarray, logits: torch.Tensor
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Sample the rows of ``logits`` (grammars applied), append the sampled tokens to the
        persistent batch and report them, with the logprobs their requests asked for.

        With deferred tokens the batch gets placeholders and the output is
        materialised later (core/worker/async_output.py), except for rows
        whose sampling reads their own history on the host (multi-token bad
        words), which wait for their ids; otherwise the ids are read now.
        """
        batch = self.batch
        sampling = batch.sampling
        if so.grammar_bitmask is not None:
            apply_grammar(so, staged, logits)
        if so.forced_token_ids:
            force_tokens(so, staged, logits)
        out = self.sampler(logits, sampling.metadata(sample_rows, batch.num_tokens, batch.token_ids))
        req_ids = staged.req_ids
        token_ids = out.token_ids
        sampling.record_sampled(sample_rows, token_ids)
        prompt_logprobs = self.prompt_logprobs.finished(staged.req_ids, staged.sample, sample_rows)

        def logprobs() -> tuple[LogprobsArrays | None, list[int] | None]:
            if out.logprobs is None:
                return None, None
            return LogprobsArrays(*out.logprobs.to_numpy()), self._logprobs_rows(staged, sample_rows)

        if not self.defer:
            sampled: list[list[int]] = [[] for _ in req_ids]
            for i, row, tok in zip(staged.sample.tolist(), sample_rows.tolist(), token_ids.tolist()):
                batch.append_token(row, tok)
                sampled[i] = [tok]
            arrays, rows = logprobs()
            return ModelRunnerOutput.for_requests(
                req_ids,
                sampled_token_ids=sampled,
                logprobs=arrays,
                logprobs_rows=rows,
                prompt_logprobs=prompt_logprobs,
            )
        tokens = SampledTokens(token_ids, self.copy_stream)
        on_host = sampling.num_rows_with["bad_words"] > 0
        for k, (i, row) in enumerate(zip(staged.sample.tolist(), sample_rows.tolist())):
            if on_host and sampling.needs_host_tokens(row):
                batch.append_token(row, tokens.tolist()[k])
                continue
            position = int(batch.num_tokens[row])
            if batch.append_token(row, PLACEHOLDER_TOKEN_ID):
                self.deferred.add(req_ids[i], tokens, k, position)
        extras = None
        if out.logprobs is not None or prompt_logprobs is not None:
            extras = lambda: (*logprobs(), prompt_logprobs)  # noqa: E731 - read on the engine thread
        return AsyncModelRunnerOutput(req_ids, staged.sample.tolist(), tokens, extras)

    def _logprobs_rows(self, staged: Staged, sample_rows: np.ndarray) -> list[int]:
        """Row of the sampler's logprobs of each scheduled request (-1: it asked for none)."""
        rows = np.full(len(staged.req_ids), -1, np.int64)
        asked = np.flatnonzero(self.batch.sampling.num_logprobs[sample_rows] >= 0)
        rows[staged.sample[asked]] = np.arange(asked.size)
        return rows.tolist()
