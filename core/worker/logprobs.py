"""Log probabilities of sampled and prompt tokens, as tensors and as wire arrays.

A token's entry is itself plus the k most likely tokens at its position,
with its rank among all tokens (1 = the most likely; ties count against it,
as in vLLM). Computed in float32 on the device for a whole batch at once.
The sampled tokens' batch crosses to the frontend as one set of arrays per
step; prompt logprobs are gathered per request across its prefill chunks
(``PromptLogprobs``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from core.protocol import LogprobsArrays

if TYPE_CHECKING:
    from core.worker.input_batch import InputBatch

# Prompt positions whose logits are taken at once: bounds the [positions, vocab]
# float32 temporaries of a long prompt.
PROMPT_LOGITS_CHUNK = 512


@dataclass
class LogprobsTensors:
    """A batch of entries: ``token_ids`` [M, k+1] int32, ``logprobs`` [M, k+1] float32, ``ranks`` [M] int32."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor

    def to_numpy(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.token_ids.cpu().numpy(), self.logprobs.cpu().numpy(), self.ranks.cpu().numpy()


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Entries for ``token_ids`` [M] from their rows of ``logits`` [M, V], k alternatives each.

    The vocabulary-wide work (log_softmax, top-k) is torch's; what follows
    touches a few values per row and on a CPU runs in numpy over the same
    memory, where each small operation costs a few microseconds instead of
    a torch dispatch's tens.
    """
    logprobs = logits.float().log_softmax(dim=-1)
    top = logprobs.topk(k, dim=-1) if k > 0 else None
    if logprobs.device.type == "cpu":
        top_arrays = None if top is None else (top.values.numpy(), top.indices.numpy())
        return _gather_on_host(logprobs.numpy(), token_ids.numpy(), top_arrays)
    return _gather_on_device(logprobs, token_ids, top)


def _gather_on_host(
    logprobs: np.ndarray, token_ids: np.ndarray, top: tuple[np.ndarray, np.ndarray] | None
) -> LogprobsTensors:
    """A token's rank is how many tokens are at least as likely: above its row's
    k-th alternative the top k tell it, and only the other rows need a count
    over the vocabulary."""
    token_ids = token_ids.astype(np.int64)
    token_logprobs = logprobs[np.arange(token_ids.size), token_ids][:, None]
    if top is None:
        ranks = (logprobs >= token_logprobs).sum(1)
        ids, values = token_ids[:, None], token_logprobs
    else:
        top_logprobs, top_ids = top
        ranks = (top_logprobs >= token_logprobs).sum(1)
        below = np.flatnonzero(token_logprobs[:, 0] <= top_logprobs[:, -1])
        if below.size:
            ranks[below] = (logprobs[below] >= token_logprobs[below]).sum(1)
        ids = np.concatenate((token_ids[:, None], top_ids), axis=1)
        values = np.concatenate((token_logprobs, top_logprobs), axis=1)
    return LogprobsTensors(
        torch.from_numpy(ids.astype(np.int32)), torch.from_numpy(values), torch.from_numpy(ranks.astype(np.int32))
    )


def _gather_on_device(logprobs: torch.Tensor, token_ids: torch.Tensor, top) -> LogprobsTensors:
    """The same with torch on the device (counting every row: picking rows would make the host wait)."""
    token_ids = token_ids.long().unsqueeze(-1)
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(-1, dtype=torch.int32)
    if top is not None:
        token_ids = torch.cat((token_ids, top.indices), dim=-1)
        token_logprobs = torch.cat((token_logprobs, top.values), dim=-1)
    return LogprobsTensors(token_ids.to(torch.int32), token_logprobs, ranks)


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
