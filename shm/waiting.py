"""How every channel end waits, written once: spin, announce, re-check, sleep, check the peer.

A wait is a generator of *steps* (``wait_steps``): ``SPIN`` means "give the
CPU away once, then I try again", a positive number means "sleep up to that
many seconds on whatever wakes this end". Between steps it calls the end's
``attempt`` (read a message, write one) and returns its first result. The
same generator is driven by a blocking loop (``drive_blocking``: threads,
``sched_yield`` and ``poll``) and by an awaiting one (``drive_async``: the
event loop, ``asyncio.sleep(0)`` and a doorbell registered with the loop),
so the shared-memory ends, their asyncio twins and the ZeroMQ baseline all
follow one policy:

1. spin for ``spin_s``, yielding the CPU between attempts (with as many
   runnable processes as cores the peer often shares ours);
2. announce the sleep (the ring's need-wakeup flag), try once more so that
   a message published in between is not missed, sleep (bounded by
   ``poll_interval``, so a dead peer is noticed even without a sentinel),
   withdraw the announcement;
3. after waking: stop if this side interrupted itself, try again (the
   likely reason we woke), and if the peer is gone try one last time for
   whatever it wrote just before dying, then raise ``PeerDeadError``.

A ``Waiter`` may stand for several ends at once (``shm.channel.ReceiverGroup``):
announcing then flags every ring and the sleep watches every doorbell.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

SPIN = -1.0  # the step that means: yield the CPU once, then attempt again


class PeerDeadError(ConnectionError):
    """The process at the other end of the channel is gone."""


class ChannelClosed(ConnectionError):
    """This side interrupted its own receiver (shutdown): stop using the channel."""


def _always_alive() -> bool:
    return True


class PeerWatch:
    """How an end tells that the process at the other end is gone.

    ``alive()`` is asked after every sleep; ``sentinel`` is an fd that becomes
    readable once the peer exits (``Process.sentinel``, a pidfd), which the
    sleeping end watches beside its doorbell so that it wakes at once. Both
    ends of a duplex share one watch, so what one end saw the other knows.
    """

    __slots__ = ("_alive", "sentinel", "fired")

    def __init__(self) -> None:
        self._alive: Callable[[], bool] = _always_alive
        self.sentinel: int | None = None
        self.fired = False

    def set(self, alive: Callable[[], bool] | None = None, sentinel: int | None = None) -> None:
        self._alive = alive or _always_alive
        self.sentinel = sentinel
        self.fired = False

    def alive(self) -> bool:
        return not self.fired and self._alive()


class Waiter(Protocol):
    """What the wait policy needs from the end (or group of ends) that waits."""

    name: str  # for error messages
    poll_interval: float  # longest sleep before the peer's liveness is checked

    def begin_wait(self) -> None:
        """Publish "I am about to sleep" (a no-op where the waker needs no flag)."""

    def end_wait(self) -> None:
        """Withdraw it."""

    def peer_alive(self) -> bool: ...

    def check_open(self) -> None:
        """Raise ChannelClosed if this side interrupted its own wait."""


def deadline_after(timeout: float | None) -> float | None:
    """The ``time.monotonic()`` deadline of a wait of ``timeout`` seconds (None: forever)."""
    return None if timeout is None else time.monotonic() + timeout


def wait_steps(
    attempt: Callable[[], T | None], waiter: Waiter, spin_s: float, deadline: float | None = None
) -> Generator[float, None, T | None]:
    """The steps of one wait for ``attempt()`` to return something other than None.

    Returns that result, or None once ``deadline`` (``time.monotonic()``) has
    passed; raises PeerDeadError when the peer is gone and a last attempt
    finds nothing, ChannelClosed when this side interrupted itself. The
    caller has usually made one attempt already (its fast path).
    """
    if spin_s > 0:
        spin_end = time.perf_counter() + spin_s
        while time.perf_counter() < spin_end:
            yield SPIN
            result = attempt()
            if result is not None:
                return result
    while True:
        waiter.begin_wait()
        try:
            result = attempt()
            if result is not None:
                return result
            budget = waiter.poll_interval
            if deadline is not None:
                budget = min(budget, deadline - time.monotonic())
                if budget <= 0:
                    return None
            yield budget
        finally:
            waiter.end_wait()
        waiter.check_open()
        result = attempt()
        if result is not None:
            return result
        if not waiter.peer_alive():
            result = attempt()  # its last words, written just before it died
            if result is not None:
                return result
            raise PeerDeadError(f"the peer of {waiter.name} is gone")


class SendingEnd(Waiter, Protocol):
    """A producing end: ``try_send`` writes without waiting; sleeps for room are counted."""

    waits_for_space: int

    def try_send(self, frames: Sequence[Any]) -> bool: ...


def send_blocking(
    end: SendingEnd, frames: Sequence[Any], sleep: Callable[[float], object], spin_s: float,
    timeout: float | None = None,
) -> None:
    """Write one message through ``end``, waiting for room (``sleep`` is the end's own
    sleep); TimeoutError after ``timeout`` seconds, PeerDeadError as ``wait_steps``."""
    if end.try_send(frames):
        return

    def sleep_for_space(seconds: float) -> None:
        end.waits_for_space += 1
        sleep(seconds)

    steps = wait_steps(lambda: end.try_send(frames) or None, end, spin_s, deadline_after(timeout))
    if drive_blocking(steps, sleep_for_space) is None:
        raise TimeoutError(f"{end.name} stayed full for {timeout} s")


def drive_blocking(steps: Generator[float, None, T], sleep: Callable[[float], object]) -> T:
    """Run a wait on this thread: ``sched_yield`` for SPIN, ``sleep(seconds)`` otherwise."""
    try:
        step = next(steps)
        while True:
            if step == SPIN:
                os.sched_yield()
            else:
                sleep(step)
            step = next(steps)
    except StopIteration as done:
        return done.value
    finally:
        steps.close()


async def drive_async(steps: Generator[float, None, T], sleep: Callable[[float], Awaitable[object]]) -> T:
    """Run a wait on the event loop: one loop iteration for SPIN (other tasks run),
    ``await sleep(seconds)`` otherwise. Cancelling it withdraws the announcement."""
    try:
        step = next(steps)
        while True:
            if step == SPIN:
                await asyncio.sleep(0)
            else:
                await sleep(step)
            step = next(steps)
    except StopIteration as done:
        return done.value
    finally:
        steps.close()
