"""Blocking message channels over shared-memory rings.

One direction is a ``ShmRing`` plus two doorbells: *data* (the producer rings
the consumer) and *space* (the consumer rings a producer that waits for room).
A ``Duplex`` pairs two directions between a creator (the frontend) and an
attacher (the spawned engine), described by a picklable ``ChannelSpec``;
``ReceiverGroup`` lets one thread receive from several rings.

Waiting follows the io_uring need-wakeup pattern, in the one policy of
``shm.waiting``: an end that finds nothing to do spins briefly, then
publishes "I am going to sleep" in the ring header, re-checks the ring, and
sleeps on its doorbell. The other side makes the doorbell syscall only when
that flag is set, so a busy channel makes no system calls at all and an idle
one burns no CPU. The spin calls ``sched_yield`` between attempts: with as
many runnable processes as cores the peer often shares our core, and a plain
spin would only delay it. A receiver does not spin at all right after its
side's sender woke an idle peer: that peer cannot answer within the spin
window, and the kernel's sync wake-up of a FIFO reader tends to run the woken
peer on the waker's CPU, which a spinning waker would keep busy
(bench/README.md has the measurements behind both choices).

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

from shm.aio import AsyncReceiver, AsyncSender
from shm.doorbell import Doorbell
from shm.ring import Frame, ShmRing
from shm.segment import unlink_segment
from shm.waiting import (
    ChannelClosed,
    PeerDeadError,
    PeerWatch,
    deadline_after,
    drive_blocking,
    send_blocking,
    wait_steps,
)

__all__ = [
    "ChannelClosed", "ChannelSpec", "DirectionSpec", "Duplex", "PeerDeadError", "Receiver", "ReceiverGroup", "Sender",
]

DEFAULT_SPIN_S = 50e-6
DEFAULT_POLL_INTERVAL_S = 0.25
QUIET_S = 1e-3  # a peer silent this long is taken to be idle (see Receiver.spin_budget)
_POLL_EVENTS = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP


class _Sleeper:
    """A ``poll`` over some doorbells and the peers' sentinels: one blocking sleep."""

    def __init__(self, bells: Sequence[Doorbell]) -> None:
        self._bells = {bell.fileno(): bell for bell in bells}
        self._poller = select.poll()
        for fd in self._bells:
            self._poller.register(fd, _POLL_EVENTS)
        self._sentinels: dict[int, PeerWatch] = {}

    def sleep(self, timeout: float, peers: Sequence[PeerWatch]) -> None:
        """Wait until a bell rings, a peer exits or ``timeout`` s pass; then clear the bells."""
        for peer in peers:  # a peer may have been given its sentinel since the last sleep
            if peer.sentinel is not None and peer.sentinel not in self._sentinels:
                self._poller.register(peer.sentinel, _POLL_EVENTS)
                self._sentinels[peer.sentinel] = peer
        for fd, _ in self._poller.poll(max(0, int(timeout * 1000 + 0.999))):
            bell = self._bells.get(fd)
            if bell is not None:
                bell.drain()
            elif fd in self._sentinels:
                self._sentinels[fd].fired = True


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
        self.name = f"ring {ring.name}"
        self.peer = PeerWatch()
        self._sleeper = _Sleeper([self.own_bell])

    @property
    def own_bell(self) -> Doorbell:
        """The doorbell this end sleeps on."""
        raise NotImplementedError

    def peer_alive(self) -> bool:
        return self.peer.alive()

    def check_open(self) -> None:
        pass

    def _sleep(self, timeout: float) -> None:
        self._sleeper.sleep(timeout, (self.peer,))


class Sender(_Endpoint):
    """The producing end of one direction."""

    waits_for_space = 0  # how often a send had to sleep because the ring was full
    woke_consumer_at = float("-inf")  # perf_counter() of the last doorbell ring
    messages_sent = 0
    doorbell_rings = 0  # wake-ups of a consumer that had gone to sleep

    @property
    def bytes_sent(self) -> int:
        return self.ring.bytes_written

    @property
    def own_bell(self) -> Doorbell:
        return self.space_bell

    def begin_wait(self) -> None:
        self.ring.begin_space_wait()

    def end_wait(self) -> None:
        self.ring.end_space_wait()

    def try_send(self, frames: Sequence[Frame]) -> bool:
        """Write without waiting. After False, a large (chunked) message may be half
        written: retry with the same ``frames`` before sending anything else."""
        done = self.ring.try_write(frames)
        if self.ring.consumer_wakeup_due():
            self.woke_consumer_at = time.perf_counter()
            self.doorbell_rings += 1
            self.data_bell.ring()
        if done:
            self.messages_sent += 1
        return done

    def send(self, frames: Sequence[Frame], timeout: float | None = None) -> None:
        """Write one message, waiting for room as long as needed (or ``timeout`` seconds:
        then TimeoutError, after which a large message may be half written and the next
        send must pass the same ``frames``). Raises PeerDeadError if the ring stays full
        and the peer is gone; while there is room, a send to a dead peer succeeds."""
        send_blocking(self, frames, self._sleep, self.spin_s, timeout)


class Receiver(_Endpoint):
    """The consuming end of one direction."""

    _interrupted = False
    partner: Sender | None = None  # this side's sender of the other direction, if any
    last_message_at = float("-inf")  # perf_counter() when a message was last returned
    messages_received = 0
    doorbell_rings = 0  # wake-ups of a producer that waited for space

    @property
    def bytes_received(self) -> int:
        return self.ring.bytes_read

    @property
    def own_bell(self) -> Doorbell:
        return self.data_bell

    def begin_wait(self) -> None:
        self.ring.begin_sleep()

    def end_wait(self) -> None:
        self.ring.end_sleep()

    def check_open(self) -> None:
        if self._interrupted:
            raise ChannelClosed(f"receiving from {self.name} was interrupted")

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

    def interrupt(self) -> None:
        """From another thread: make a blocked or later ``recv`` raise ChannelClosed,
        so the thread that receives can finish before the channel is closed."""
        self._interrupted = True
        self.data_bell.ring()

    def try_recv(self) -> list[bytes] | None:
        """The next message if one is complete, else None; never waits."""
        frames = self.ring.try_read()
        if self.ring.producer_wakeup_due():
            self.doorbell_rings += 1
            self.space_bell.ring()
        if frames is not None:
            self.messages_received += 1
            self.last_message_at = time.perf_counter()
        return frames

    def recv(self, timeout: float | None = None) -> list[bytes] | None:
        """The next message, waiting as long as needed; None after ``timeout`` seconds.
        Raises PeerDeadError once the ring is empty and the peer is gone: whatever the
        peer wrote before dying is delivered first."""
        frames = self.try_recv()
        if frames is not None:
            return frames
        steps = wait_steps(self.try_recv, self, self.spin_budget(self.spin_s), deadline_after(timeout))
        return drive_blocking(steps, self._sleep)


class ReceiverGroup:
    """Several receivers served by one thread: the next message from any of them.

    The rings are read round robin, so a busy peer cannot starve the others;
    a sleep announces itself on every ring and wakes on any doorbell or any
    peer's exit. ``recv`` returns ``(index, frames)`` and raises PeerDeadError
    once any peer is gone and its ring is drained.
    """

    def __init__(self, receivers: Sequence[Receiver]) -> None:
        if not receivers:
            raise ValueError("a receiver group needs at least one receiver")
        self.receivers = list(receivers)
        self.spin_s = min(r.spin_s for r in self.receivers)
        self.poll_interval = min(r.poll_interval for r in self.receivers)
        self.name = f"a group of {len(self.receivers)} rings"
        self._next = 0
        self._interrupted = False
        self._sleeper = _Sleeper([r.data_bell for r in self.receivers])

    def try_recv(self) -> tuple[int, list[bytes]] | None:
        receivers = self.receivers
        n = len(receivers)
        for k in range(n):
            index = (self._next + k) % n
            frames = receivers[index].try_recv()
            if frames is not None:
                self._next = (index + 1) % n
                return index, frames
        return None

    def recv(self, timeout: float | None = None) -> tuple[int, list[bytes]] | None:
        """The next message of any receiver as (index, frames); None after ``timeout`` s."""
        got = self.try_recv()
        if got is not None:
            return got
        steps = wait_steps(self.try_recv, self, self.spin_s, deadline_after(timeout))
        return drive_blocking(steps, self._sleep)

    def begin_wait(self) -> None:
        for receiver in self.receivers:
            receiver.ring.begin_sleep()

    def end_wait(self) -> None:
        for receiver in self.receivers:
            receiver.ring.end_sleep()

    def peer_alive(self) -> bool:
        return all(r.peer_alive() for r in self.receivers)

    def check_open(self) -> None:
        if self._interrupted:
            raise ChannelClosed(f"receiving from {self.name} was interrupted")

    def interrupt(self) -> None:
        """From another thread: make a blocked or later ``recv`` raise ChannelClosed."""
        self._interrupted = True
        self.receivers[0].data_bell.ring()

    def _sleep(self, timeout: float) -> None:
        self._sleeper.sleep(timeout, [r.peer for r in self.receivers])


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

    def unlink(self) -> None:
        """Remove every name (segments, FIFOs, their directory), attached or not; names
        already gone are skipped."""
        for direction in (self.forward, self.backward):
            unlink_segment(direction.segment)
            for bell in (direction.data_bell, direction.space_bell):
                try:
                    os.unlink(bell)
                except FileNotFoundError:
                    pass
        try:
            os.rmdir(self.directory)
        except FileNotFoundError:
            pass


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
        # One watch for both directions: what one end sees of the peer, the other knows.
        self.peer = sender.peer = receiver.peer = PeerWatch()

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
    def attach(cls, spec: ChannelSpec, *, creator_side: bool = False, **endpoint_options: float) -> Duplex:
        """Open the creator's segments and FIFOs: as the attacher (the other side), or with
        ``creator_side`` as the creator's stand-in (a process the creator hands its side to)."""
        fwd, bwd = spec.forward, spec.backward
        if creator_side:
            sender = Sender(
                ShmRing.attach(fwd.segment), Doorbell.open(fwd.data_bell), Doorbell.open(fwd.space_bell),
                **endpoint_options,
            )
            receiver = Receiver(
                ShmRing.attach(bwd.segment), Doorbell.open(bwd.data_bell), Doorbell.open(bwd.space_bell),
                **endpoint_options,
            )
            return cls(sender, receiver, spec)
        receiver = Receiver(
            ShmRing.attach(fwd.segment), Doorbell.open(fwd.data_bell), Doorbell.open(fwd.space_bell),
            **endpoint_options,
        )
        sender = Sender(
            ShmRing.attach(bwd.segment), Doorbell.open(bwd.data_bell), Doorbell.open(bwd.space_bell),
            **endpoint_options,
        )
        return cls(sender, receiver, spec)

    def set_peer(self, alive: Callable[[], bool] | None, sentinel: int | None = None) -> None:
        """Liveness of the other process, for both directions (see ``PeerWatch``)."""
        self.peer.set(alive, sentinel)

    def peer_attached(self, timeout: float) -> None:
        """Creator side, once the attacher said hello: drop every name (``unlink``)."""
        self.unlink()

    def async_ends(self) -> tuple[AsyncSender, AsyncReceiver]:
        """Event-loop ends over this duplex (see ``shm.aio``)."""
        return AsyncSender(self.sender), AsyncReceiver(self.receiver)

    def unlink(self) -> None:
        """Remove every name (segments, FIFOs, their directory). Call it once both sides
        have attached: the channel keeps working, and a later crash leaves nothing behind."""
        self.spec.unlink()

    def close(self) -> None:
        """Unmap and close this side's handles (and unlink whatever is left). Threads
        using the sender or receiver must have stopped."""
        self.unlink()
        for end in (self.sender, self.receiver):
            end.ring.close()
            end.data_bell.close()
            end.space_bell.close()
