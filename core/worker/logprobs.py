"""Log probabilities of tokens: the sampler's math.

A token's entry is itself plus the k most likely tokens at its position,
with its rank among all tokens (1 = the most likely; ties count against it,
as in vLLM). Computed in float32 on the device for a whole batch at once.
The sampled tokens' batch crosses to the frontend as one set of arrays per
step; prompt logprobs are gathered per request across its prefill chunks
by the runner (core/worker/prompt_logprobs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


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
