"""asyncio ends of a channel, for the frontend's event loop.

They use no thread. When the ring is empty the receiver first polls it for
``spin_s`` while yielding to the loop at every check (other tasks keep
running; an answer that comes back within microseconds costs no wake-up),
then publishes the ring's sleeping flag, re-checks, and awaits the doorbell,
which is registered once with ``loop.add_reader``. A sender that finds the
ring full does the latter directly. While messages keep flowing the doorbell
is never rung, so the event loop sees no fd events at all. A timer (``liveness_interval``) bounds every sleep so that a dead peer
is noticed; a peer sentinel fd, if the endpoint has one, wakes the receiver
at once. Only the receiver watches the sentinel: an event loop keeps one
reader per fd, so a second registration would silently replace the first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from shm.channel import PeerDeadError, Receiver, Sender, _Endpoint
from shm.doorbell import Doorbell
from shm.ring import Frame

DEFAULT_LIVENESS_INTERVAL_S = 0.5


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class _AsyncEnd:
    """Doorbell registration and the sleep/liveness logic shared by both async ends."""

    def __init__(
        self,
        endpoint: _Endpoint,
        bell: Doorbell,
        peer_alive: Callable[[], bool] | None,
        liveness_interval: float,
        watch_sentinel: bool,
    ) -> None:
        self._endpoint = endpoint
        self._watch_sentinel = watch_sentinel
        self._bell = bell
        self._peer_alive = peer_alive or endpoint.peer_alive
        self.liveness_interval = liveness_interval
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future | None = None
        self._sentinel: int | None = None
        self._sentinel_fired = False

    def _register(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            loop.add_reader(self._bell.fileno(), self._on_ring)
            self._sentinel = self._endpoint._sentinel if self._watch_sentinel else None
            if self._sentinel is not None:
                loop.add_reader(self._sentinel, self._on_sentinel)
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
        self._sentinel_fired = True
        if self._waiter is not None:
            _wake(self._waiter)

    async def _sleep(self, loop: asyncio.AbstractEventLoop) -> None:
        self._waiter = fut = loop.create_future()
        timer = loop.call_later(self.liveness_interval, _wake, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._waiter = None

    def peer_alive(self) -> bool:
        return not self._sentinel_fired and self._peer_alive()

    def close(self) -> None:
        """Unregister from the event loop (before the channel's fds are closed)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._bell.fileno())
            if self._sentinel is not None and not self._sentinel_fired:
                self._loop.remove_reader(self._sentinel)
        self._loop = None


class AsyncReceiver(_AsyncEnd):
    """``await recv()`` on the event loop. One coroutine receives at a time.

    While messages are already waiting, ``recv`` returns without suspending, but
    yields to the loop every ``max_burst`` messages so a fast producer cannot
    starve other tasks.
    """

    def __init__(
        self,
        receiver: Receiver,
        peer_alive: Callable[[], bool] | None = None,
        *,
        liveness_interval: float = DEFAULT_LIVENESS_INTERVAL_S,
        max_burst: int = 16,
        spin_s: float | None = None,
    ) -> None:
        super().__init__(receiver, receiver.data_bell, peer_alive, liveness_interval, watch_sentinel=True)
        self._receiver = receiver
        self.max_burst = max_burst
        self.spin_s = receiver.spin_s if spin_s is None else spin_s
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
        spin_s = receiver.spin_budget(self.spin_s)
        if spin_s > 0:
            spin_end = time.perf_counter() + spin_s
            while time.perf_counter() < spin_end:
                await asyncio.sleep(0)  # one loop iteration: other tasks run meanwhile
                frames = receiver.try_recv()
                if frames is not None:
                    return frames
        loop = self._register()
        ring = receiver.ring
        while True:
            ring.begin_sleep()
            try:
                frames = receiver.try_recv()
                if frames is not None:
                    return frames
                await self._sleep(loop)
            finally:
                ring.end_sleep()
            frames = receiver.try_recv()
            if frames is not None:
                return frames
            if not self.peer_alive():
                frames = receiver.try_recv()  # its last words, written just before it died
                if frames is not None:
                    return frames
                raise PeerDeadError(f"peer of ring {ring.name} is gone")


class AsyncSender(_AsyncEnd):
    """``await send(frames)`` on the event loop; concurrent callers are served in order."""

    def __init__(
        self,
        sender: Sender,
        peer_alive: Callable[[], bool] | None = None,
        *,
        liveness_interval: float = DEFAULT_LIVENESS_INTERVAL_S,
    ) -> None:
        super().__init__(sender, sender.space_bell, peer_alive, liveness_interval, watch_sentinel=False)
        self._sender = sender
        self._lock: asyncio.Lock | None = None

    async def send(self, frames: Sequence[Frame]) -> None:
        """Write one message, awaiting room; PeerDeadError if the ring stays full and the peer is gone."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        lock = self._lock
        if not lock.locked():
            if self._sender.try_send(frames):
                return
            # Possibly half written (chunked): taking a free lock does not yield,
            # so nobody can slip another message in before this one is finished.
        async with lock:
            await self._send_waiting(frames)

    async def _send_waiting(self, frames: Sequence[Frame]) -> None:
        sender = self._sender
        loop = self._register()
        ring = sender.ring
        while True:
            ring.begin_space_wait()
            try:
                if sender.try_send(frames):
                    return
                sender.waits_for_space += 1
                await self._sleep(loop)
            finally:
                ring.end_space_wait()
            if sender.try_send(frames):
                return
            if not self.peer_alive():
                raise PeerDeadError(f"peer of ring {ring.name} is gone while the ring is full")
