"""Requests whose output starts inside the model's reasoning (``ReasoningParams``).

Their grammar waits for the end of the reasoning, and a budget may force that
end. The only state is the scheduler's ``Request.reasoning``: the params while
the end token is not among the request's output tokens, None from the step
that appends it. It is a function of the output tokens alone, so preemption
(which keeps them) keeps it. Drafts (speculative decoding) are only looked
through here, never committed: the scheduler appends accepted tokens only, so
an end token in a rejected draft leaves the request reasoning, and the grammar's
matcher, fed nothing before the end, has nothing to roll back.

A step that samples k + 1 tokens for a request (k drafts, row j checking
``drafts[j]``, the last row the bonus token) has its rows split in two: those
up to the first draft that is the end token are still inside the reasoning (no
grammar row; forced to the end token from the budget on), the rest are the
grammar's, from its start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.protocol import ReasoningParams

if TYPE_CHECKING:
    from core.structured.request import StructuredOutputRequest


def rows_in_reasoning(reasoning: ReasoningParams, drafts: list[int]) -> int:
    """How many of the step's ``len(drafts) + 1`` rows are still inside the reasoning: every
    row up to the one that checks the first draft equal to the end token, or all of them."""
    end = reasoning.end_token_id
    for j, token_id in enumerate(drafts):
        if token_id == end:
            return j + 1
    return len(drafts) + 1


def forced_rows(reasoning: ReasoningParams, num_output: int, reasoning_rows: int) -> range:
    """The rows, among the first ``reasoning_rows``, whose token the budget forces to be the
    end token: row j samples output token ``num_output + j``, forced from index ``budget`` on."""
    budget = reasoning.budget
    if budget is None:
        return range(0)
    return range(max(budget - num_output, 0), reasoning_rows)


def valid_drafts(
    reasoning: ReasoningParams, structured: StructuredOutputRequest | None, num_output: int, drafts: list[int]
) -> list[int]:
    """The longest prefix of ``drafts`` (following ``num_output`` output tokens) the request
    may take: inside the reasoning any token, except that from the budget on only the end
    token; after the end token, what the grammar accepts."""
    end, budget = reasoning.end_token_id, reasoning.budget
    for j, token_id in enumerate(drafts):
        if token_id == end:
            rest = drafts[j + 1 :]
            if rest and structured is not None:
                rest = structured.valid_drafts(rest)
            return drafts[: j + 1] + rest
        if budget is not None and num_output + j >= budget:
            return drafts[:j]
    return drafts
