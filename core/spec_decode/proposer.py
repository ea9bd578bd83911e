"""What the speculator asks of a proposer, whichever way it guesses the next tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from core.worker.input_batch import InputBatch


@dataclass
class Proposal:
    """One request's drafts, and the draft distribution each was drawn from (None: greedy,
    or drafts that were looked up rather than drawn: point masses)."""

    token_ids: list[int]
    probs: torch.Tensor | None  # [k, vocab] float32


class Proposer(Protocol):
    """Proposes drafts after a step (n-gram lookup, a draft model): what the speculator calls."""

    def draft(self, req_ids: list[str], rows: list[int], batch: InputBatch, budgets: list[int]) -> dict[str, Proposal]:
        """Drafts (up to ``budgets[i]``) for requests ``req_ids`` at persistent-batch ``rows``, whose
        known tokens are ``batch.token_ids[row, :batch.num_tokens[row]]``; a request without
        any is left out."""
        ...

    def forget(self, req_id: str) -> None:
        """The request finished or was preempted: drop what was kept for it (drafting for it
        again starts afresh)."""
        ...
