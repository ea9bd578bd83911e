"""The ZeroMQ baseline: vLLM V1's socket pattern behind the channel interface.

It exists so that the shared-memory rings can be measured against what they
replace, in the same binary (``--transport zmq``). The pattern is the seeds':
requests go from a ROUTER (creator, the frontend) to a DEALER (attacher, the
engine, routing id = engine index), outputs from a PUSH (engine) to a PULL
(frontend); every message is one multipart message; tensors travel as aux
frames (no out-of-band tier). Both sockets are ``ipc://`` endpoints in a
private directory whose names are removed once the engine has connected.

The surface mirrors ``shm.channel`` (``Duplex.create/attach``, ``sender.send``,
``receiver.recv``, ``set_peer_alive``, ``unlink``, ``close``) and
``shm.aio`` (``AsyncSender``/``AsyncReceiver``), so the engine and clients
run unchanged over either. Waiting uses ``zmq.Poller`` with the peer's
sentinel fd beside the socket, so a dead peer is noticed at once.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio

from shm.channel import DEFAULT_POLL_INTERVAL_S, ChannelClosed, PeerDeadError
from shm.ring import Frame

ENGINE_IDENTITY = (0).to_bytes(2, "little")  # engine index 0, as vLLM encodes it
_REGISTER = b""  # the DEALER's first message: lets the ROUTER learn its routing id
_COPY_THRESHOLD = 64 * 1024  # below this zmq copies frames, as pyzmq advises


def _always_alive() -> bool:
    return True


@dataclass(frozen=True)
class ZmqChannelSpec:
    """Addresses the engine connects to; picklable (a spawn argument)."""

    input_address: str  # ROUTER (frontend) -> DEALER (engine)
    output_address: str  # PUSH (engine) -> PULL (frontend)
    directory: str


class _End:
    """One socket plus the liveness of the process at the other end."""

    def __init__(self, socket: zmq.Socket, poll_interval: float) -> None:
        self.socket = socket
        self.poll_interval = poll_interval
        self.waits_for_space = 0
        self._alive: Callable[[], bool] = _always_alive
        self._sentinel: int | None = None
        self._sentinel_fired = False

    def set_peer(self, alive: Callable[[], bool] | None, sentinel: int | None) -> None:
        self._alive = alive or _always_alive
        self._sentinel = sentinel
        self._sentinel_fired = False

    def peer_alive(self) -> bool:
        return not self._sentinel_fired and self._alive()

    def _wait(self, event: int, timeout: float) -> bool:
        """Poll the socket for ``event`` and the sentinel; True if the socket is ready."""
        poller = zmq.Poller()
        poller.register(self.socket, event)
        if self._sentinel is not None:
            poller.register(self._sentinel, zmq.POLLIN)
        ready = dict(poller.poll(max(0, int(timeout * 1000 + 0.999))))
        if self._sentinel is not None and ready.get(self._sentinel):
            self._sentinel_fired = True
        return bool(ready.get(self.socket, 0) & event)

    def _budget(self, deadline: float | None) -> float:
        if deadline is None:
            return self.poll_interval
        return min(self.poll_interval, deadline - time.monotonic())


class ZmqSender(_End):
    """Sends multipart messages; on a ROUTER every message is addressed to ``identity``."""

    def __init__(self, socket: zmq.Socket, poll_interval: float, identity: bytes | None) -> None:
        super().__init__(socket, poll_interval)
        self.identity = identity
        self.registered = identity is None

    def frames_out(self, frames: Sequence[Frame]) -> list:
        out = list(frames)
        return out if self.identity is None else [self.identity, *out]

    def try_send(self, frames: Sequence[Frame]) -> bool:
        try:
            self.socket.send_multipart(self.frames_out(frames), flags=zmq.NOBLOCK, copy=_copy(frames))
        except zmq.Again:
            return False
        return True

    def send(self, frames: Sequence[Frame], timeout: float | None = None) -> None:
        if self.try_send(frames):
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            budget = self._budget(deadline)
            if budget <= 0:
                raise TimeoutError(f"zmq socket stayed full for {timeout} s")
            self.waits_for_space += 1
            if self._wait(zmq.POLLOUT, budget) and self.try_send(frames):
                return
            if not self.peer_alive():
                raise PeerDeadError("peer of the zmq channel is gone while sending")


class ZmqReceiver(_End):
    """Receives multipart messages."""

    _interrupted = False

    def interrupt(self) -> None:
        """From another thread: a blocked ``recv`` raises ChannelClosed within one poll
        interval, so the receiving thread is done with the socket before it is closed."""
        self._interrupted = True

    def try_recv(self) -> list | None:
        try:
            parts = self.socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return _frames_in(parts)

    def recv(self, timeout: float | None = None) -> list | None:
        frames = self.try_recv()
        if frames is not None:
            return frames
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            budget = self._budget(deadline)
            if budget <= 0:
                return None
            if self._wait(zmq.POLLIN, budget):
                frames = self.try_recv()
                if frames is not None:
                    return frames
            if self._interrupted:
                raise ChannelClosed("receiving from the zmq channel was interrupted")
            if not self.peer_alive():
                frames = self.try_recv()
                if frames is not None:
                    return frames
                raise PeerDeadError("peer of the zmq channel is gone")


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

    def wait_registered(self, timeout: float) -> None:
        """Creator side: block until the engine's DEALER has announced itself."""
        sender = self.sender
        if sender.registered:
            return
        receiver = ZmqReceiver(sender.socket, self.receiver.poll_interval)
        receiver.set_peer(sender._alive, sender._sentinel)
        parts = receiver.recv(timeout)
        if parts is None:
            raise TimeoutError("the engine's DEALER did not register in time")
        if parts[0] != ENGINE_IDENTITY:
            raise RuntimeError(f"unexpected zmq peer {parts[0]!r}")
        sender.registered = True

    def set_peer_alive(self, alive: Callable[[], bool] | None, sentinel: int | None = None) -> None:
        self.sender.set_peer(alive, sentinel)
        self.receiver.set_peer(alive, sentinel)

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

    def __init__(self, receiver: ZmqReceiver, liveness_interval: float = 0.5) -> None:
        self._receiver = receiver
        self._socket = zmq.asyncio.Socket.from_socket(receiver.socket)
        self.liveness_interval = liveness_interval

    async def recv(self) -> list:
        while True:
            frames = self._receiver.try_recv()
            if frames is not None:
                return frames
            events = await self._socket.poll(int(self.liveness_interval * 1000), zmq.POLLIN)
            if not events and not self._receiver.peer_alive():
                frames = self._receiver.try_recv()
                if frames is not None:
                    return frames
                raise PeerDeadError("peer of the zmq channel is gone")

    def close(self) -> None:
        """Unregister from the loop; this also closes the shadowed socket (shutdown only)."""
        self._socket.close(linger=0)


class ZmqAsyncSender:
    """``await send(frames)``; waits for POLLOUT when the peer is slow."""

    def __init__(self, sender: ZmqSender, liveness_interval: float = 0.5) -> None:
        self._sender = sender
        self._socket = zmq.asyncio.Socket.from_socket(sender.socket)
        self.liveness_interval = liveness_interval

    async def send(self, frames: Sequence[Frame]) -> None:
        sender = self._sender
        while not sender.try_send(frames):
            sender.waits_for_space += 1
            events = await self._socket.poll(int(self.liveness_interval * 1000), zmq.POLLOUT)
            if not events and not sender.peer_alive():
                raise PeerDeadError("peer of the zmq channel is gone while sending")

    def close(self) -> None:
        """Unregister from the loop; this also closes the shadowed socket (shutdown only)."""
        self._socket.close(linger=0)
