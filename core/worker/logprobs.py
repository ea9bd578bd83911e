"""Log probabilities of sampled and prompt tokens, as tensors and as wire arrays.

A token's entry is itself plus the k most likely tokens at its position,
with its rank among all tokens (1 = the most likely; ties count against it,
as in vLLM). Computed in float32 on the device for a whole batch at once.
The sampled tokens' batch crosses to the frontend as one set of arrays per
step; prompt logprobs are cut per request (``split_rows``, numpy views).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from core.protocol import LogprobsArrays

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

    A logprob is the logit minus the row's log-sum-exp (log_softmax without
    materialising it: only k + 1 values per row are wanted).
    """
    token_ids = token_ids.long().unsqueeze(-1)
    token_logits = logits.gather(-1, token_ids)
    ranks = (logits >= token_logits).sum(-1, dtype=torch.int32)
    if k > 0:
        top_logits, top_ids = logits.topk(k, dim=-1)
        token_ids = torch.cat((token_ids, top_ids), dim=-1)
        token_logits = torch.cat((token_logits, top_logits), dim=-1)
    logprobs = token_logits.float() - logits.float().logsumexp(dim=-1, keepdim=True)
    return LogprobsTensors(token_ids.to(torch.int32), logprobs, ranks)


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
    compute_logits, hidden: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor, k: int
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
