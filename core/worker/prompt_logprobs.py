"""Prompt logprobs of requests in their prefill: the runner's bookkeeping across chunks.

The entries are computed with the sampler's math (core/worker/logprobs.py)
from extra logits rows of the prompt positions, chunk by chunk, and handed
over whole in the step that samples the request's first token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from core.protocol import LogprobsArrays
from core.worker.input_batch import InputBatch
from core.worker.logprobs import gather_logprobs

# Prompt positions whose logits are taken at once: bounds the [positions, vocab]
# float32 temporaries of a long prompt.
PROMPT_LOGITS_CHUNK = 512


def split_rows(arrays: tuple[np.ndarray, np.ndarray, np.ndarray], k: int, start: int, stop: int) -> LogprobsArrays:
    """Rows ``start:stop`` of a batch, cut to ``k`` alternatives."""
    ids, logprobs, ranks = arrays
    return LogprobsArrays(ids[start:stop, : k + 1], logprobs[start:stop, : k + 1], ranks[start:stop])


def concat(parts: list[LogprobsArrays], k: int) -> LogprobsArrays:
    """Chunks of one request's prompt logprobs, in order, as one entry set (empty when none)."""
    if not parts:
        return LogprobsArrays(
            np.zeros((0, k + 1), np.int32), np.zeros((0, k + 1), np.float32), np.zeros(0, np.int32)
        )
    if len(parts) == 1:
        return parts[0]
    return LogprobsArrays(
        np.concatenate([p.token_ids for p in parts]),
        np.concatenate([p.logprobs for p in parts]),
        np.concatenate([p.ranks for p in parts]),
    )


def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    positions: torch.Tensor,
    targets: torch.Tensor,
    k: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Entries of the prompt tokens ``targets`` [P] predicted by ``hidden[positions]``,
    from the model's raw logits (``compute_logits``), in chunks of PROMPT_LOGITS_CHUNK."""
    parts = []
    for start in range(0, positions.shape[0], PROMPT_LOGITS_CHUNK):
        stop = start + PROMPT_LOGITS_CHUNK
        logits = compute_logits(hidden[positions[start:stop]])
        parts.append(gather_logprobs(logits, targets[start:stop], k).to_numpy())
    if len(parts) == 1:
        return parts[0]
    return tuple(np.concatenate(column) for column in zip(*parts))  # type: ignore[return-value]


class StepLayout(Protocol):
    """Where each scheduled request's chunk lies in a step's flat batch (the runner's staging)."""

    req_ids: list[str]
    rows: np.ndarray  # persistent-batch row of each scheduled request
    computed: np.ndarray  # its tokens in the KV cache before this step
    counts: np.ndarray  # its tokens in this step
    starts: np.ndarray  # its first flat position


class PromptLogprobs:
    """Prompt logprobs of requests still in their prefill: computed chunk by chunk,
    delivered whole in the step that samples the request's first token.

    The hidden state at position p predicts token p + 1, so a chunk over
    positions [c, c + n) yields the entries of prompt tokens c + 1 .. c + n
    that exist. They come from extra logits rows, for these requests only.
    """

    def __init__(self, batch: InputBatch, device: torch.device) -> None:
        self.batch = batch
        self.device = device
        self.parts: dict[str, list[LogprobsArrays]] = {}

    def forget(self, req_id: str) -> None:
        """The request left the batch (finished, preempted, or re-added from scratch)."""
        self.parts.pop(req_id, None)

    def collect(
        self, step: StepLayout, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """The entries this step's chunks yield, for the requests still owed theirs."""
        batch = self.batch
        owed = batch.sampling.prompt_logprobs
        rows, computed, counts, starts = step.rows, step.computed, step.counts, step.starts
        num_prompt = batch.sampling.num_prompt_tokens[rows]
        picked = []  # (request index, flat start, first position, count)
        for i in np.flatnonzero(owed[rows] >= 0).tolist():
            n = int(min(computed[i] + counts[i], num_prompt[i] - 1) - computed[i])
            if n > 0:
                picked.append((i, int(starts[i]), int(computed[i]), n))
        if not picked:
            return
        positions = np.concatenate([np.arange(start, start + n) for _, start, _, n in picked])
        targets = np.concatenate([batch.token_ids[rows[i], first + 1 : first + 1 + n] for i, _, first, n in picked])
        k = int(max(owed[rows[i]] for i, *_ in picked))
        arrays = prompt_logprobs(
            compute_logits,
            hidden,
            torch.from_numpy(positions).to(self.device),
            torch.from_numpy(targets).to(self.device),
            k,
        )
        offset = 0
        for i, _, _, n in picked:
            part = split_rows(arrays, int(owed[rows[i]]), offset, offset + n)
            self.parts.setdefault(step.req_ids[i], []).append(part)
            offset += n

    def finished(
        self, req_ids: list[str], sample: np.ndarray, sample_rows: np.ndarray
    ) -> dict[str, LogprobsArrays] | None:
        """Whole prompt logprobs of the requests that sample their first token now
        (``sample``: their indices in ``req_ids``; ``sample_rows``: their batch rows)."""
        sampling = self.batch.sampling
        if not sampling.num_rows_with["prompt_logprobs"]:
            return None
        done: dict[str, LogprobsArrays] = {}
        for position, row in enumerate(sample_rows.tolist()):
            k = int(sampling.prompt_logprobs[row])
            if k >= 0:
                req_id = req_ids[int(sample[position])]
                done[req_id] = concat(self.parts.pop(req_id, []), k)
                sampling.prompt_logprobs_delivered(row)
        return done or None
