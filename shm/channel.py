"""Blocking message channels over shared-memory rings.

One direction is a ``ShmRing`` plus two doorbells: *data* (the producer rings
the consumer) and *space* (the consumer rings a producer that waits for room).
A ``Duplex`` pairs two directions between a creator (the frontend) and an
attacher (the spawned engine), described by a picklable ``ChannelSpec``.

Waiting follows the io_uring need-wakeup pattern: a side that finds nothing to
do spins briefly, then publishes "I am going to sleep" in the ring header,
re-checks the ring (so a message published in between is not missed), and
sleeps on its doorbell. The other side makes the doorbell syscall only when
that flag is set, so a busy channel makes no system calls at all and an idle
one burns no CPU. The spin calls ``sched_yield`` between attempts: with as many
runnable processes as cores (2 here) the peer often shares our core, and a
plain spin would only delay it (measured: ping-pong p50 140 µs spinning, 8 µs
yielding; pipelined small messages 230k/s vs 600k/s). A receiver does not spin
at all right after its side's sender woke an idle peer: that peer cannot answer
within the spin window, and the kernel's sync wake-up of a FIFO reader tends to
run the woken peer on the waker's CPU, which a spinning waker would keep busy
(measured: round trip from idle 250 -> 200 µs). Sleeps are bounded
(``poll_interval``) so that a dead peer is noticed even without a process
sentinel.

Threading: a ``Sender`` and a ``Receiver`` are each used by one thread at a
time. The two directions are independent, so a side that both sends and
receives must do so from separate threads (or, in asyncio, separate tasks
via ``shm.aio``); then both rings being full at once cannot deadlock, because
each side's receiver keeps draining while its sender waits.
"""

from __future__ import annotations

import os
import select
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shm.doorbell import Doorbell
from shm.ring import Frame, ShmRing

DEFAULT_SPIN_S = 50e-6
DEFAULT_POLL_INTERVAL_S = 0.25
QUIET_S = 1e-3  # a peer silent this long is taken to be idle (see Receiver.spin_budget)
_POLL_EVENTS = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP


class PeerDeadError(ConnectionError):
    """The process at the other end of the channel is gone."""


class ChannelClosed(ConnectionError):
    """This side interrupted its own receiver (shutdown): stop using the channel."""


def _always_alive() -> bool:
    return True


class _Endpoint:
    """What a sender and a receiver share: a ring, two doorbells, the peer's liveness."""

    def __init__(
        self,
        ring: ShmRing,
        data_bell: Doorbell,
        space_bell: Doorbell,
        *,
        spin_s: float = DEFAULT_SPIN_S,
        poll_interval: float = DEFAULT_POLL_INTERVAL_S,
    ) -> None:
        self.ring = ring
        self.data_bell = data_bell
        self.space_bell = space_bell
        self.spin_s = spin_s
        self.poll_interval = poll_interval
        self._peer_alive: Callable[[], bool] = _always_alive
        self._sentinel: int | None = None
        self._sentinel_fired = False
        self._poller = select.poll()
        self._poller.register(self._own_bell().fileno(), _POLL_EVENTS)

    def _own_bell(self) -> Doorbell:
        raise NotImplementedError

    def set_peer(self, alive: Callable[[], bool] | None = None, sentinel: int | None = None) -> None:
        """How to tell the peer is gone: ``alive()`` is asked at every wake-up from a
        sleep; ``sentinel`` (an fd that becomes readable when the peer exits, such as
        ``Process.sentinel`` or a pidfd) also wakes the sleeper at once."""
        self._peer_alive = alive or _always_alive
        if self._sentinel is not None:
            self._poller.unregister(self._sentinel)
        self._sentinel = sentinel
        self._sentinel_fired = False
        if sentinel is not None:
            self._poller.register(sentinel, _POLL_EVENTS)

    def peer_alive(self) -> bool:
        return not self._sentinel_fired and self._peer_alive()

    def _sleep(self, timeout: float) -> None:
        """Wait on our doorbell (and the peer's sentinel), then clear the doorbell."""
        for fd, _ in self._poller.poll(max(0, int(timeout * 1000 + 0.999))):
            if fd == self._sentinel:
                self._sentinel_fired = True
        self._own_bell().drain()

    def _wait_budget(self, deadline: float | None) -> float:
        if deadline is None:
            return self.poll_interval
        return min(self.poll_interval, deadline - time.monotonic())


class Sender(_Endpoint):
    """The producing end of one direction."""

    waits_for_space = 0  # how often send() had to sleep because the ring was full
    woke_consumer_at = float("-inf")  # perf_counter() of the last doorbell ring

    def _wake_consumer(self) -> None:
        self.woke_consumer_at = time.perf_counter()
        self.data_bell.ring()

    def _own_bell(self) -> Doorbell:
        return self.space_bell

    def _notify(self) -> None:
        if self.ring.consumer_wakeup_due():
            self._wake_consumer()

    def try_send(self, frames: Sequence[Frame]) -> bool:
        """Write without waiting. After False, a large (chunked) message may be half
        written: retry with the same ``frames`` before sending anything else."""
        done = self.ring.try_write(frames)
        self._notify()
        return done

    def send(self, frames: Sequence[Frame], timeout: float | None = None) -> None:
        """Write one message, waiting for room as long as needed (or ``timeout`` seconds:
        then TimeoutError, after which a large message may be half written and the next
        send must pass the same ``frames``). Raises PeerDeadError if the ring stays full
        and the peer is gone; while there is room, a send to a dead peer succeeds."""
        ring = self.ring
        if ring.try_write(frames):
            if ring.consumer_wakeup_due():
                self._wake_consumer()
            return
        self._notify()  # a chunked message may have made progress
        deadline = None if timeout is None else time.monotonic() + timeout
        spin_end = time.perf_counter() + self.spin_s
        while time.perf_counter() < spin_end:
            os.sched_yield()
            done = ring.try_write(frames)
            self._notify()
            if done:
                return
        while True:
            ring.begin_space_wait()
            try:
                done = ring.try_write(frames)
                self._notify()
                if done:
                    return
                budget = self._wait_budget(deadline)
                if budget <= 0:
                    raise TimeoutError(f"ring {ring.name} stayed full for {timeout} s")
                self.waits_for_space += 1
                self._sleep(budget)
            finally:
                ring.end_space_wait()
            if not self.peer_alive():
                done = ring.try_write(frames)
                self._notify()
                if done:
                    return
                raise PeerDeadError(f"peer of ring {ring.name} is gone while the ring is full")


class Receiver(_Endpoint):
    """The consuming end of one direction."""

    _interrupted = False
    partner: Sender | None = None  # this side's sender of the other direction, if any
    last_message_at = float("-inf")  # perf_counter() when a message was last returned

    def spin_budget(self, spin_s: float) -> float:
        """``spin_s``, or no spin at all when the peer had been quiet for a while
        (``QUIET_S``) and our sender has just rung it awake: it is coming out of a
        deep sleep and cannot answer within the spin window (module docstring).
        The quiet condition keeps a busy ping-pong that once fell asleep from
        staying asleep: there, every message would ring a peer that skipped its spin."""
        partner = self.partner
        if partner is not None:
            now = time.perf_counter()
            if now - partner.woke_consumer_at < spin_s and now - self.last_message_at > QUIET_S:
                return 0.0
        return spin_s

    def _own_bell(self) -> Doorbell:
        return self.data_bell

    def interrupt(self) -> None:
        """From another thread: make a blocked or later ``recv`` raise ChannelClosed,
        so the thread that receives can finish before the channel is closed."""
        self._interrupted = True
        self.data_bell.ring()

    def _notify(self) -> None:
        if self.ring.producer_wakeup_due():
            self.space_bell.ring()

    def try_recv(self) -> list[bytes] | None:
        """The next message if one is complete, else None; never waits."""
        frames = self.ring.try_read()
        if self.ring.producer_wakeup_due():
            self.space_bell.ring()
        if frames is not None:
            self.last_message_at = time.perf_counter()
        return frames

    def recv(self, timeout: float | None = None) -> list[bytes] | None:
        """The next message, waiting as long as needed; None after ``timeout`` seconds.
        Raises PeerDeadError once the ring is empty and the peer is gone: whatever the
        peer wrote before dying is delivered first."""
        frames = self._recv(timeout)
        if frames is not None:
            self.last_message_at = time.perf_counter()
        return frames

    def _recv(self, timeout: float | None) -> list[bytes] | None:
        ring = self.ring
        frames = ring.try_read()
        self._notify()
        if frames is not None:
            return frames
        deadline = None if timeout is None else time.monotonic() + timeout
        spin_end = time.perf_counter() + self.spin_budget(self.spin_s)
        while time.perf_counter() < spin_end:
            os.sched_yield()
            frames = ring.try_read()
            self._notify()
            if frames is not None:
                return frames
        while True:
            ring.begin_sleep()
            try:
                frames = ring.try_read()
                self._notify()
                if frames is not None:
                    return frames
                budget = self._wait_budget(deadline)
                if budget <= 0:
                    return None
                self._sleep(budget)
            finally:
                ring.end_sleep()
            if self._interrupted:
                raise ChannelClosed(f"receiving from ring {ring.name} was interrupted")
            frames = ring.try_read()  # the likely reason we woke: answer it first
            self._notify()
            if frames is not None:
                return frames
            if not self.peer_alive():
                frames = ring.try_read()  # its last words, written just before it died
                self._notify()
                if frames is not None:
                    return frames
                raise PeerDeadError(f"peer of ring {ring.name} is gone")


@dataclass(frozen=True)
class DirectionSpec:
    """Names of one direction's ring segment and doorbell FIFOs."""

    segment: str
    data_bell: str
    space_bell: str


@dataclass(frozen=True)
class ChannelSpec:
    """Everything the attaching process needs; picklable, so it can be a spawn argument."""

    forward: DirectionSpec  # creator -> attacher
    backward: DirectionSpec  # attacher -> creator
    directory: str  # private (0700) directory holding the FIFOs


class Duplex:
    """Both directions of a channel, as seen from one side."""

    def __init__(
        self,
        sender: Sender,
        receiver: Receiver,
        spec: ChannelSpec,
    ) -> None:
        self.sender = sender
        self.receiver = receiver
        self.spec = spec
        receiver.partner = sender

    @classmethod
    def create(cls, capacity: int = 1 << 22, **endpoint_options: float) -> tuple[Duplex, ChannelSpec]:
        """Make the segments and FIFOs (creator side). ``capacity`` is per direction."""
        directory = tempfile.mkdtemp(prefix="ringllm-")
        made: list[ShmRing | Doorbell] = []
        try:
            fwd_ring = ShmRing.create(capacity)
            made.append(fwd_ring)
            bwd_ring = ShmRing.create(capacity)
            made.append(bwd_ring)
            bells = []
            for name in ("fwd-data", "fwd-space", "bwd-data", "bwd-space"):
                bells.append(Doorbell.create(directory, name))
                made.append(bells[-1])
        except BaseException:
            for obj in made:
                obj.unlink()
                obj.close()
            os.rmdir(directory)
            raise
        fwd_data, fwd_space, bwd_data, bwd_space = bells
        spec = ChannelSpec(
            forward=DirectionSpec(fwd_ring.name, fwd_data.path, fwd_space.path),
            backward=DirectionSpec(bwd_ring.name, bwd_data.path, bwd_space.path),
            directory=directory,
        )
        duplex = cls(
            Sender(fwd_ring, fwd_data, fwd_space, **endpoint_options),
            Receiver(bwd_ring, bwd_data, bwd_space, **endpoint_options),
            spec,
        )
        return duplex, spec

    @classmethod
    def attach(cls, spec: ChannelSpec, **endpoint_options: float) -> Duplex:
        """Open the creator's segments and FIFOs (attacher side)."""
        fwd, bwd = spec.forward, spec.backward
        receiver = Receiver(
            ShmRing.attach(fwd.segment), Doorbell.open(fwd.data_bell), Doorbell.open(fwd.space_bell),
            **endpoint_options,
        )
        sender = Sender(
            ShmRing.attach(bwd.segment), Doorbell.open(bwd.data_bell), Doorbell.open(bwd.space_bell),
            **endpoint_options,
        )
        return cls(sender, receiver, spec)

    def set_peer_alive(self, alive: Callable[[], bool] | None, sentinel: int | None = None) -> None:
        """Liveness of the other process, for both directions (see ``_Endpoint.set_peer``)."""
        self.sender.set_peer(alive, sentinel)
        self.receiver.set_peer(alive, sentinel)

    def unlink(self) -> None:
        """Remove every name (segments, FIFOs, their directory). Call it once both sides
        have attached: the channel keeps working, and a later crash leaves nothing behind."""
        for end in (self.sender, self.receiver):
            end.ring.unlink()
            end.data_bell.unlink()
            end.space_bell.unlink()
        try:
            os.rmdir(self.spec.directory)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap and close this side's handles (and unlink whatever is left). Threads
        using the sender or receiver must have stopped."""
        self.unlink()
        for end in (self.sender, self.receiver):
            end.ring.close()
            end.data_bell.close()
            end.space_bell.close()
