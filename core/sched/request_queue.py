"""The waiting queue, behind a small interface so the policy can change.

The scheduler only ever looks at the head (``peek``/``pop``), puts preempted
requests back in front (``prepend``) and drops aborted ones (``remove``).
First-come-first-served is a deque; a priority policy would implement the
same methods over a heap.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Protocol

from core.sched.request import Request


class RequestQueue(Protocol):
    def add_request(self, request: Request) -> None: ...

    def prepend_request(self, request: Request) -> None: ...

    def peek_request(self) -> Request: ...

    def pop_request(self) -> Request: ...

    def remove_requests(self, requests: Iterable[Request]) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class FCFSRequestQueue:
    """Arrival order, with preempted requests jumping back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek_request(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty request queue")
        return self._queue[0]

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def remove_requests(self, requests: Iterable[Request]) -> None:
        """O(queue length): aborts of waiting requests are rare and batched."""
        doomed = {id(r) for r in requests}
        if doomed:
            self._queue = deque(r for r in self._queue if id(r) not in doomed)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        raise NotImplementedError("the priority scheduling policy is not implemented yet; use fcfs")
    raise ValueError(f"unknown scheduling policy {policy!r}")
