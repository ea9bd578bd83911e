"""The waiting queue, behind a small interface so the policy can change.

The scheduler only ever looks at the head (``peek``/``pop``), puts preempted
requests back (``prepend``) and drops aborted ones (``remove``).
First-come-first-served is a deque; the priority policy is a heap.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Protocol

from core.request import Request


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


class PriorityRequestQueue:
    """Lowest ``priority`` value first, then earliest ``arrival_time``.

    A preempted request goes back to the place its own (priority, arrival
    time) gives it, not to the front: jumping ahead of a more urgent request
    would invert priorities. A counter breaks exact ties in insertion order
    and keeps ``Request`` objects out of comparisons.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty request queue")
        return self._heap[0][3]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove_requests(self, requests: Iterable[Request]) -> None:
        """O(queue length): aborts of waiting requests are rare and batched."""
        doomed = {id(r) for r in requests}
        if doomed:
            self._heap = [entry for entry in self._heap if id(entry[3]) not in doomed]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In scheduling order (sorts a copy: for inspection, not the hot path)."""
        return (entry[3] for entry in sorted(self._heap))


SCHEDULING_POLICIES = ("fcfs", "priority")


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; expected one of {SCHEDULING_POLICIES}")
