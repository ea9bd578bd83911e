"""The ZeroMQ baseline: vLLM V1's socket pattern behind the channel interface.

It exists so that the shared-memory rings can be measured against what they
replace, in the same binary (``--transport zmq``). The pattern is vLLM V1's:
requests go from a ROUTER (creator, the frontend) to a DEALER (attacher, the
engine, routing id = engine index), outputs from a PUSH (engine) to a PULL
(frontend); every message is one multipart message; tensors travel as aux
frames (no out-of-band tier). Both sockets are ``ipc://`` endpoints in a
private directory whose names are removed once the engine has connected.

``ZmqDuplex`` implements ``shm.interface.Channel`` like the rings' ``Duplex``,
so the engine and clients run unchanged over either. Waiting follows
``shm.waiting``'s policy; a sleep is a ``zmq.Poller`` poll with the peer's
sentinel fd beside the socket, so a dead peer is noticed at once.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio

from shm.channel import DEFAULT_POLL_INTERVAL_S
from shm.ring import Frame
from shm.waiting import ChannelClosed, PeerWatch, deadline_after, drive_async, drive_blocking, send_blocking, wait_steps

ENGINE_IDENTITY = (0).to_bytes(2, "little")  # engine index 0, as vLLM encodes it
_REGISTER = b""  # the DEALER's first message: lets the ROUTER learn its routing id
_COPY_THRESHOLD = 64 * 1024  # below this zmq copies frames, as pyzmq advises


@dataclass(frozen=True)
class ZmqChannelSpec:
    """Addresses the engine connects to; picklable (a spawn argument)."""

    input_address: str  # ROUTER (frontend) -> DEALER (engine)
    output_address: str  # PUSH (engine) -> PULL (frontend)
    directory: str


class _End:
    """One socket plus the liveness of the process at the other end.

    It is a ``shm.waiting.Waiter`` with nothing to announce: zmq's own I/O
    thread wakes a poller, so a sleep is a poll on the socket and the peer's
    sentinel, and there is no spin (zmq's latency is far above a spin's).
    """

    def __init__(self, socket: zmq.Socket, poll_interval: float, event: int) -> None:
        self.socket = socket
        self.poll_interval = poll_interval
        self.name = "the zmq channel"
        self.peer = PeerWatch()
        self._event = event

    def begin_wait(self) -> None:
        pass

    def end_wait(self) -> None:
        pass

    def check_open(self) -> None:
        pass

    def peer_alive(self) -> bool:
        return self.peer.alive()

    def _sleep(self, timeout: float) -> None:
        """Poll the socket for this end's event and the sentinel."""
        poller = zmq.Poller()
        poller.register(self.socket, self._event)
        sentinel = self.peer.sentinel
        if sentinel is not None:
            poller.register(sentinel, zmq.POLLIN)
        ready = dict(poller.poll(max(0, int(timeout * 1000 + 0.999))))
        if sentinel is not None and ready.get(sentinel):
            self.peer.fired = True


class ZmqSender(_End):
    """Sends multipart messages; on a ROUTER every message is addressed to ``identity``."""

    def __init__(self, socket: zmq.Socket, poll_interval: float, identity: bytes | None) -> None:
        super().__init__(socket, poll_interval, zmq.POLLOUT)
        self.identity = identity
        self.registered = identity is None
        self.waits_for_space = 0
        self.messages_sent = 0
        self.bytes_sent = 0
        self.doorbell_rings = 0  # zmq's own I/O thread wakes the peer: no doorbells here

    def frames_out(self, frames: Sequence[Frame]) -> list:
        out = list(frames)
        return out if self.identity is None else [self.identity, *out]

    def try_send(self, frames: Sequence[Frame]) -> bool:
        try:
            self.socket.send_multipart(self.frames_out(frames), flags=zmq.NOBLOCK, copy=_copy(frames))
        except zmq.Again:
            return False
        self.messages_sent += 1
        self.bytes_sent += sum(map(len, frames))
        return True

    def send(self, frames: Sequence[Frame], timeout: float | None = None) -> None:
        send_blocking(self, frames, self._sleep, 0.0, timeout)


class ZmqReceiver(_End):
    """Receives multipart messages."""

    _interrupted = False
    messages_received = 0
    bytes_received = 0
    doorbell_rings = 0

    def __init__(self, socket: zmq.Socket, poll_interval: float) -> None:
        super().__init__(socket, poll_interval, zmq.POLLIN)

    def check_open(self) -> None:
        if self._interrupted:
            raise ChannelClosed("receiving from the zmq channel was interrupted")

    def interrupt(self) -> None:
        """From another thread: a blocked ``recv`` raises ChannelClosed within one poll
        interval, so the receiving thread is done with the socket before it is closed."""
        self._interrupted = True

    def try_recv(self) -> list | None:
        try:
            parts = self.socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        self.messages_received += 1
        self.bytes_received += sum(map(len, parts))
        return _frames_in(parts)

    def recv(self, timeout: float | None = None) -> list | None:
        frames = self.try_recv()
        if frames is not None:
            return frames
        return drive_blocking(wait_steps(self.try_recv, self, 0.0, deadline_after(timeout)), self._sleep)


def _copy(frames: Sequence[Frame]) -> bool:
    """Copy small messages (cheaper than zmq's zero-copy bookkeeping), not big ones."""
    return all(len(f) < _COPY_THRESHOLD for f in frames)


def _frames_in(parts: list) -> list:
    """Small frames as bytes; large ones as zero-copy memoryviews of zmq's buffers."""
    return [p.bytes if len(p) < _COPY_THRESHOLD else p.buffer for p in parts]


class ZmqDuplex:
    """Both sockets of one side. The frontend creates (binds), the engine attaches (connects)."""

    def __init__(
        self, context: zmq.Context, sender: ZmqSender, receiver: ZmqReceiver, spec: ZmqChannelSpec
    ) -> None:
        self.context = context
        self.sender = sender
        self.receiver = receiver
        self.spec = spec
        self.peer = sender.peer = receiver.peer = PeerWatch()

    @classmethod
    def create(
        cls, capacity: int = 0, *, poll_interval: float = DEFAULT_POLL_INTERVAL_S
    ) -> tuple[ZmqDuplex, ZmqChannelSpec]:
        """Bind both sockets in a new private directory. ``capacity`` is unused (shm only)."""
        directory = tempfile.mkdtemp(prefix="ringllm-zmq-")
        spec = ZmqChannelSpec(
            input_address=f"ipc://{directory}/input",
            output_address=f"ipc://{directory}/output",
            directory=directory,
        )
        context = zmq.Context(io_threads=2)
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # never drop a message silently
        router.setsockopt(zmq.LINGER, 0)
        router.bind(spec.input_address)
        pull = context.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.bind(spec.output_address)
        sender = ZmqSender(router, poll_interval, identity=ENGINE_IDENTITY)
        return cls(context, sender, ZmqReceiver(pull, poll_interval), spec), spec

    @classmethod
    def attach(cls, spec: ZmqChannelSpec, *, poll_interval: float = DEFAULT_POLL_INTERVAL_S) -> ZmqDuplex:
        context = zmq.Context(io_threads=1)
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.ROUTING_ID, ENGINE_IDENTITY)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(spec.input_address)
        dealer.send(_REGISTER)  # the ROUTER cannot address us before it has heard from us
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(spec.output_address)
        return cls(context, ZmqSender(push, poll_interval, identity=None), ZmqReceiver(dealer, poll_interval), spec)

    def peer_attached(self, timeout: float) -> None:
        """Creator side, once the engine said hello: wait until its DEALER has
        announced itself (the ROUTER cannot address it before), then remove the
        socket files."""
        sender = self.sender
        if not sender.registered:
            registration = ZmqReceiver(sender.socket, self.receiver.poll_interval)
            registration.peer = self.peer
            parts = registration.recv(timeout)
            if parts is None:
                raise TimeoutError("the engine's DEALER did not register in time")
            if parts[0] != ENGINE_IDENTITY:
                raise RuntimeError(f"unexpected zmq peer {parts[0]!r}")
            sender.registered = True
        self.unlink()

    def set_peer(self, alive: Callable[[], bool] | None, sentinel: int | None = None) -> None:
        self.peer.set(alive, sentinel)

    def async_ends(self) -> tuple[ZmqAsyncSender, ZmqAsyncReceiver]:
        return ZmqAsyncSender(self.sender), ZmqAsyncReceiver(self.receiver)

    def unlink(self) -> None:
        """Remove the ipc socket files (connections already made keep working)."""
        shutil.rmtree(self.spec.directory, ignore_errors=True)

    def close(self) -> None:
        self.unlink()
        self.sender.socket.close(linger=0)
        self.receiver.socket.close(linger=0)
        self.context.term()


class ZmqAsyncReceiver:
    """``await recv()`` over a shadow asyncio socket; never blocks the loop."""

    def __init__(self, receiver: ZmqReceiver) -> None:
        self._receiver = receiver
        self._socket = zmq.asyncio.Socket.from_socket(receiver.socket)

    async def recv(self) -> list:
        receiver = self._receiver
        frames = receiver.try_recv()
        if frames is not None:
            return frames
        return await drive_async(wait_steps(receiver.try_recv, receiver, 0.0), self._poll)

    async def _poll(self, timeout: float) -> None:
        await self._socket.poll(int(timeout * 1000 + 0.999), zmq.POLLIN)

    def close(self) -> None:
        """Unregister from the loop; this also closes the shadowed socket (shutdown only)."""
        self._socket.close(linger=0)


class ZmqAsyncSender:
    """``await send(frames)``; waits for POLLOUT when the peer is slow."""

    def __init__(self, sender: ZmqSender) -> None:
        self._sender = sender
        self._socket = zmq.asyncio.Socket.from_socket(sender.socket)

    async def send(self, frames: Sequence[Frame]) -> None:
        sender = self._sender
        if sender.try_send(frames):
            return
        await drive_async(wait_steps(lambda: sender.try_send(frames) or None, sender, 0.0), self._poll)

    async def _poll(self, timeout: float) -> None:
        self._sender.waits_for_space += 1
        await self._socket.poll(int(timeout * 1000 + 0.999), zmq.POLLOUT)

    def close(self) -> None:
        """Unregister from the loop; this also closes the shadowed socket (shutdown only)."""
        self._socket.close(linger=0)
