"""Waiting for conditions, with deadlines generous enough for a loaded 2-core machine.

A test never sleeps and hopes: it polls the condition it needs until it holds,
and fails naming what it waited for once the deadline has passed.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")
DEADLINE_S = 30.0


def wait_for(predicate: Callable[[], T], what: str, seconds: float = DEADLINE_S, interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that;
    AssertionError naming ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {seconds:.0f} s waiting for {what}")
        time.sleep(interval)


async def wait_until(
    predicate: Callable[[], Any | Awaitable[Any]], what: str, seconds: float = DEADLINE_S, interval: float = 0.01
) -> Any:
    """The event-loop twin of ``wait_for``: ``predicate`` may be a coroutine function."""
    deadline = time.monotonic() + seconds
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {seconds:.0f} s waiting for {what}")
        await asyncio.sleep(interval)
