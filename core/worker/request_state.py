"""What the runner's parts keep per request, and the one way they hear of requests.

The persistent batch holds the tokens; other parts keep their own state of a
request beside it (sampled ids still on the device, prompt logprobs gathered
chunk by chunk, a draft model's KV blocks and draft budgets, a pooling
request's partial pool). Each is told the same three things in the same
words, so the runner fans a scheduler step's arrivals, finishes and
preemptions out to a list instead of calling each part by its own name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from core.sched.output import NewRequestData


class RequestState(Protocol):
    def add_request(self, new: NewRequestData) -> None:
        """A request enters the batch: new, or resumed after a preemption."""

    def forget(self, req_id: str) -> None:
        """The request finished: nothing of it is needed again."""

    def reset(self, req_id: str) -> None:
        """The request was preempted: it comes back later and recomputes from its tokens."""


class DroppedOnAnyChange:
    """A part whose state of a request only ever goes (arrival, finish and preemption alike):
    its one ``drop`` serves all three."""

    def __init__(self, drop: Callable[[str], None]) -> None:
        self.drop = drop

    def add_request(self, new: NewRequestData) -> None:
        self.drop(new.req_id)

    def forget(self, req_id: str) -> None:
        self.drop(req_id)

    def reset(self, req_id: str) -> None:
        self.drop(req_id)
