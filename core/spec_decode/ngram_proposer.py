"""Draft tokens by prompt lookup: what followed the request's last n tokens before.

Text that quotes, edits or summarises its prompt (code changes, extraction,
retrieval answers) repeats spans of it; when a request's last n tokens
already occurred earlier in its context, the tokens that followed them then
are a cheap guess at what comes next. The longest match between
``prompt_lookup_max`` and ``prompt_lookup_min`` tokens wins, among equals the
most recent one that k tokens follow; no match, no drafts, and the step is a
plain decode.
"""

from __future__ import annotations

import numpy as np

from core.config import SpeculativeConfig
from core.spec_decode.proposer import Proposal
from core.worker.input_batch import InputBatch


class NgramProposer:
    """A Proposer that looks drafts up in each request's own tokens: it keeps nothing per request."""

    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, tokens: np.ndarray, k: int | None = None) -> np.ndarray:
        """Up to ``k`` (default: num_speculative_tokens) drafts following ``tokens``,
        a request's known tokens; empty when its suffix occurs nowhere before."""
        last = tokens.size - 1
        if last < self.min_n:
            return tokens[:0]
        # Candidate matches end where the last token occurs earlier; extend them backwards
        # one token at a time while they agree with the suffix.
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        if ends.size == 0:
            return tokens[:0]
        length = np.ones(ends.size, np.int64)
        alive = np.ones(ends.size, np.bool_)
        for back in range(1, min(self.max_n, last)):
            pos = ends - back
            alive &= pos >= 0
            alive[alive] = tokens[pos[alive]] == tokens[last - back]
            if not alive.any():
                break
            length += alive
        best = int(length.max())
        if best < self.min_n:
            return tokens[:0]
        k = k or self.k
        matches = ends[length == best]
        # The most recent match that k tokens follow; failing that the earliest (most follow it).
        full = matches[last - matches >= k]
        end = int(full[-1] if full.size else matches[0])
        return tokens[end + 1 : end + 1 + k]

    def draft(self, req_ids: list[str], rows: list[int], batch: InputBatch, budgets: list[int]) -> dict[str, Proposal]:
        """``propose`` for each request (the Proposer protocol); drafts looked up, not drawn."""
        proposals = {}
        for req_id, row, k in zip(req_ids, rows, budgets):
            drafts = self.propose(batch.token_ids[row, : batch.num_tokens[row]], k)
            if drafts.size:
                proposals[req_id] = Proposal(drafts.tolist(), None)
        return proposals

    def forget(self, req_id: str) -> None:
        """Nothing to drop: a lookup reads only the request's tokens."""
