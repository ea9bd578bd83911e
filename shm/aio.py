"""asyncio ends of a channel, for the frontend's event loop.

They use no thread and wait by the policy of ``shm.waiting``, driven on the
loop: the receiver's spin yields to the loop at every check (other tasks keep
running; an answer that comes back within microseconds costs no wake-up),
and a sleep awaits the doorbell, which is registered once with
``loop.add_reader``. While messages keep flowing the doorbell is never rung,
so the event loop sees no fd events at all. Every sleep is bounded by the
blocking end's ``poll_interval`` so that a dead peer is noticed; the peer's
sentinel fd, if it has one, wakes the receiver at once. Only the receiver
watches the sentinel: an event loop keeps one reader per fd, so a second
registration would silently replace the first (the sender still sees the
death through the duplex's shared ``PeerWatch``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from shm.doorbell import Doorbell
from shm.ring import Frame
from shm.waiting import PeerWatch, Waiter, drive_async, wait_steps


class BlockingReceiver(Waiter, Protocol):
    """What an asyncio receiver needs of the blocking end it wraps (``shm.channel.Receiver``)."""

    data_bell: Doorbell
    peer: PeerWatch
    spin_s: float

    def try_recv(self) -> list | None: ...

    def spin_budget(self, spin_s: float) -> float: ...


class BlockingSender(Waiter, Protocol):
    """What an asyncio sender needs of the blocking end it wraps (``shm.channel.Sender``)."""

    space_bell: Doorbell
    peer: PeerWatch
    waits_for_space: int

    def try_send(self, frames: Sequence[Frame]) -> bool: ...


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class _LoopSleeper:
    """One end's sleep on the event loop: until its doorbell rings, the peer's
    sentinel fires (if watched) or the timeout passes."""

    def __init__(self, bell: Doorbell, peer: PeerWatch, watch_sentinel: bool) -> None:
        self._bell = bell
        self._peer = peer
        self._watch_sentinel = watch_sentinel
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sentinel: int | None = None
        self._waiter: asyncio.Future | None = None

    def _register(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            loop.add_reader(self._bell.fileno(), self._on_ring)
            sentinel = self._peer.sentinel if self._watch_sentinel else None
            if sentinel is not None and not self._peer.fired:
                loop.add_reader(sentinel, self._on_sentinel)
                self._sentinel = sentinel
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("an async channel end is bound to the event loop that first used it")
        return loop

    def _on_ring(self) -> None:
        self._bell.drain()
        if self._waiter is not None:
            _wake(self._waiter)

    def _on_sentinel(self) -> None:
        # The sentinel stays readable once the peer is gone: stop watching it.
        assert self._loop is not None and self._sentinel is not None
        self._loop.remove_reader(self._sentinel)
        self._sentinel = None
        self._peer.fired = True
        if self._waiter is not None:
            _wake(self._waiter)

    async def sleep(self, timeout: float) -> None:
        loop = self._register()
        self._waiter = fut = loop.create_future()
        timer = loop.call_later(timeout, _wake, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._waiter = None

    def close(self) -> None:
        """Unregister from the event loop (before the channel's fds are closed)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._bell.fileno())
            if self._sentinel is not None:
                self._loop.remove_reader(self._sentinel)
        self._loop = None
        self._sentinel = None


class AsyncReceiver:
    """``await recv()`` on the event loop. One coroutine receives at a time.

    While messages are already waiting, ``recv`` returns without suspending, but
    yields to the loop every ``max_burst`` messages so a fast producer cannot
    starve other tasks.
    """

    def __init__(self, receiver: BlockingReceiver, *, max_burst: int = 16) -> None:
        self._receiver = receiver
        self._sleeper = _LoopSleeper(receiver.data_bell, receiver.peer, watch_sentinel=True)
        self.max_burst = max_burst
        self._burst = 0

    async def recv(self) -> list[bytes]:
        """The next message; raises PeerDeadError once the ring is empty and the peer gone."""
        receiver = self._receiver
        frames = receiver.try_recv()
        if frames is not None:
            self._burst += 1
            if self._burst >= self.max_burst:
                self._burst = 0
                await asyncio.sleep(0)
            return frames
        self._burst = 0
        steps = wait_steps(receiver.try_recv, receiver, receiver.spin_budget(receiver.spin_s))
        return await drive_async(steps, self._sleeper.sleep)

    def close(self) -> None:
        self._sleeper.close()


class AsyncSender:
    """``await send(frames)`` on the event loop; concurrent callers are served in order."""

    def __init__(self, sender: BlockingSender) -> None:
        self._sender = sender
        self._sleeper = _LoopSleeper(sender.space_bell, sender.peer, watch_sentinel=False)
        self._lock: asyncio.Lock | None = None

    async def send(self, frames: Sequence[Frame]) -> None:
        """Write one message, awaiting room; PeerDeadError if the ring stays full and the peer is gone."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        lock = self._lock
        sender = self._sender
        if not lock.locked() and sender.try_send(frames):
            return
        # Possibly half written (chunked): taking a free lock does not yield,
        # so nobody can slip another message in before this one is finished.
        async with lock:
            if sender.try_send(frames):
                return
            steps = wait_steps(lambda: sender.try_send(frames) or None, sender, 0.0)
            await drive_async(steps, self._sleep_for_space)

    async def _sleep_for_space(self, timeout: float) -> None:
        self._sender.waits_for_space += 1
        await self._sleeper.sleep(timeout)

    def close(self) -> None:
        self._sleeper.close()
