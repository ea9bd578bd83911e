"""The ZeroMQ baseline: vLLM V1's socket pattern behind the channel interface.

It exists so that the shared-memory rings can be measured against what they
replace, in the same binary (``--transport zmq``). The pattern is vLLM V1's:
requests go from a ROUTER (creator, the frontend) to a DEALER (attacher, the
engine, routing id = engine index), outputs from a PUSH (engine) to a PULL
(frontend); every message is one multipart message; tensors travel as aux
frames (no out-of-band tier). Both sockets are ``ipc://`` endpoints in a
private directory whose names are removed once the engine has connected, or,
for an engine on another host, ``tcp://`` endpoints on ephemeral ports
(``ZmqDuplex.create(host=...)``).

``ZmqDuplex`` implements ``shm.interface.Channel`` like the rings' ``Duplex``,
so the engine and clients run unchanged over either. Waiting follows
``shm.waiting``'s policy; a sleep is a ``zmq.Poller`` poll with the peer's
sentinel fd beside the socket, so a dead peer is noticed at once.

Over TCP the peer may have no sentinel (another host). Both sides then send
ZMTP heartbeats, so a silent peer's connection is dropped within
``HEARTBEAT_TIMEOUT_MS``, and a thread (``_LinkWatch``) reads both sockets'
monitors: once an established connection is lost the peer counts as dead and
an fd that every sleeping end polls becomes readable, so a blocked ``recv`` or
``send`` raises ``PeerDeadError`` at once (an asyncio end within one poll
interval). A lost connection is final: a peer that comes back is not taken back.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio

from shm.channel import DEFAULT_POLL_INTERVAL_S
from shm.ring import Frame
from shm.waiting import (
    ChannelClosed,
    PeerDeadError,
    PeerWatch,
    deadline_after,
    drive_async,
    drive_blocking,
    send_blocking,
    wait_steps,
)

ENGINE_IDENTITY = (0).to_bytes(2, "little")  # engine index 0, as vLLM encodes it
_REGISTER = b""  # the DEALER's first message: lets the ROUTER learn its routing id
_COPY_THRESHOLD = 64 * 1024  # below this zmq copies frames, as pyzmq advises

# TCP only: ZMTP PINGs every second; a connection that has carried nothing for
# HEARTBEAT_TIMEOUT_MS (no PONG, no data) is dropped, which counts as a dead peer.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000


@dataclass(frozen=True)
class ZmqChannelSpec:
    """Addresses the engine connects to; picklable (a spawn argument)."""

    input_address: str  # ROUTER (frontend) -> DEALER (engine)
    output_address: str  # PUSH (engine) -> PULL (frontend)
    directory: str | None = None  # ipc: the private directory of the socket files; tcp: None

    @property
    def is_tcp(self) -> bool:
        return self.input_address.startswith("tcp://")


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
        self.link: _LinkWatch | None = None  # tcp: the connections' monitor
        self._event = event

    def begin_wait(self) -> None:
        pass

    def end_wait(self) -> None:
        pass

    def check_open(self) -> None:
        pass

    def peer_alive(self) -> bool:
        link = self.link
        return (link is None or not link.lost) and self.peer.alive()

    def _sleep(self, timeout: float) -> None:
        """Poll the socket for this end's event, the sentinel and (tcp) the link watch."""
        poller = zmq.Poller()
        poller.register(self.socket, self._event)
        sentinel = self.peer.sentinel
        if sentinel is not None:
            poller.register(sentinel, zmq.POLLIN)
        if self.link is not None:
            poller.register(self.link.fd, zmq.POLLIN)
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
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH and self.registered:  # ROUTER_MANDATORY: its connection is gone
                raise PeerDeadError(f"the peer of {self.name} is gone") from exc
            raise
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
        self, context: zmq.Context, sender: ZmqSender, receiver: ZmqReceiver, spec: ZmqChannelSpec,
        link: _LinkWatch | None = None,
    ) -> None:
        self.context = context
        self.sender = sender
        self.receiver = receiver
        self.spec = spec
        self.peer = sender.peer = receiver.peer = PeerWatch()
        self.link = sender.link = receiver.link = link

    @classmethod
    def create(
        cls, capacity: int = 0, *, poll_interval: float = DEFAULT_POLL_INTERVAL_S,
        host: str | None = None, advertise_host: str | None = None,
    ) -> tuple[ZmqDuplex, ZmqChannelSpec]:
        """Bind both sockets. ``capacity`` is unused (shm only).

        ``host`` None: ``ipc://`` endpoints in a new private directory. Otherwise
        ``tcp://{host}:*`` (ephemeral ports; ``*``/``0.0.0.0``/``::`` bind every
        interface), and the spec names ``advertise_host`` (default ``host``): the
        address a remote engine connects to.
        """
        context = zmq.Context(io_threads=2)
        try:
            router = context.socket(zmq.ROUTER)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # never drop a message silently
            pull = context.socket(zmq.PULL)
            sockets = (router, pull)
            for socket in sockets:
                socket.setsockopt(zmq.LINGER, 0)
            if host is None:
                directory: str | None = tempfile.mkdtemp(prefix="ringllm-zmq-")
                spec = ZmqChannelSpec(f"ipc://{directory}/input", f"ipc://{directory}/output", directory)
                router.bind(spec.input_address)
                pull.bind(spec.output_address)
                link = None
            else:
                bind_host = "*" if host in ("", "0.0.0.0") else host
                public = advertise_host or host
                for socket in sockets:
                    _set_tcp_options(socket, bind_host if bind_host != "*" else public)
                addresses = []
                for socket in sockets:
                    socket.bind(f"tcp://{_bracket(bind_host)}:*")
                    port = socket.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
                    addresses.append(f"tcp://{_bracket(public)}:{port}")
                spec = ZmqChannelSpec(addresses[0], addresses[1], None)
                link = _LinkWatch(context, sockets)
        except BaseException:
            context.destroy(linger=0)
            raise
        sender = ZmqSender(router, poll_interval, identity=ENGINE_IDENTITY)
        return cls(context, sender, ZmqReceiver(pull, poll_interval), spec, link), spec

    @classmethod
    def attach(cls, spec: ZmqChannelSpec, *, poll_interval: float = DEFAULT_POLL_INTERVAL_S) -> ZmqDuplex:
        context = zmq.Context(io_threads=1)
        try:
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.ROUTING_ID, ENGINE_IDENTITY)
            push = context.socket(zmq.PUSH)
            sockets = (dealer, push)
            for socket in sockets:
                socket.setsockopt(zmq.LINGER, 0)
                if spec.is_tcp:
                    _set_tcp_options(socket, spec.input_address[len("tcp://"):].rsplit(":", 1)[0])
            # Watch before connecting, so that no event of these connections is missed.
            link = _LinkWatch(context, sockets) if spec.is_tcp else None
            dealer.connect(spec.input_address)
            dealer.send(_REGISTER)  # the ROUTER cannot address us before it has heard from us
            push.connect(spec.output_address)
        except BaseException:
            context.destroy(linger=0)
            raise
        return cls(
            context, ZmqSender(push, poll_interval, identity=None), ZmqReceiver(dealer, poll_interval), spec, link
        )

    def peer_attached(self, timeout: float) -> None:
        """Creator side, once the engine said hello: wait until its DEALER has
        announced itself (the ROUTER cannot address it before), then remove the
        socket files (ipc)."""
        sender = self.sender
        if not sender.registered:
            registration = ZmqReceiver(sender.socket, self.receiver.poll_interval)
            registration.peer = self.peer
            registration.link = self.link
            parts = registration.recv(timeout)
            if parts is None:
                raise TimeoutError("the engine's DEALER did not register in time")
            if parts[0] != ENGINE_IDENTITY:
                raise RuntimeError(f"unexpected zmq peer {parts[0]!r}")
            sender.registered = True
        self.unlink()

    def set_peer(self, alive: Callable[[], bool] | None, sentinel: int | None = None) -> None:
        """How to tell the peer process is gone (beside, over tcp, its lost connection)."""
        self.peer.set(alive, sentinel)

    def async_ends(self) -> tuple[ZmqAsyncSender, ZmqAsyncReceiver]:
        return ZmqAsyncSender(self.sender), ZmqAsyncReceiver(self.receiver)

    def unlink(self) -> None:
        """Remove the ipc socket files (connections already made keep working); tcp: nothing."""
        if self.spec.directory:
            shutil.rmtree(self.spec.directory, ignore_errors=True)

    def close(self) -> None:
        self.unlink()
        if self.link is not None:
            self.link.close()  # first: its monitor sockets live in our context
        self.sender.socket.close(linger=0)
        self.receiver.socket.close(linger=0)
        self.context.term()


def _bracket(host: str) -> str:
    """An IPv6 literal in brackets, as a zmq tcp endpoint needs it."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _set_tcp_options(socket: zmq.Socket, host: str) -> None:
    """Heartbeats (a silent peer's connection is dropped), and IPv6 where the host is one."""
    socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    socket.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)  # what the peer applies to us
    if ":" in host.strip("[]"):
        socket.setsockopt(zmq.IPV6, 1)


_EVENT = struct.Struct("=Hi")  # a monitor message's first frame: event id, value
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class _LinkWatch:
    """Notices that a tcp duplex's peer is gone: one of its connections was lost.

    A thread reads the monitors of both sockets (only it touches them; zmq
    sockets are not thread-safe). libzmq reports a connection that never
    finished its ZMTP handshake (a port scanner, a stray client) with a
    HANDSHAKE_FAILED event before its DISCONNECTED, so those are ignored; any
    other DISCONNECTED is the loss of an established connection (the peer
    closed, died, or went silent past the heartbeat timeout). Then ``lost`` is
    set and ``fd`` becomes readable, for good: the sleeping ends poll it as they
    poll a process sentinel.
    """

    def __init__(self, context: zmq.Context, sockets: Sequence[zmq.Socket]) -> None:
        self.lost = False
        self.fd, self._lost_w = os.pipe()
        self._stop_r, self._stop_w = os.pipe()
        events = zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
        monitors = []
        try:
            for socket in sockets:
                monitors.append(socket.get_monitor_socket(events))
        except BaseException:
            for monitor in monitors:
                monitor.close(linger=0)
            self._close_fds()
            raise
        self._thread = threading.Thread(target=self._run, args=(monitors,), name="zmq-link-watch", daemon=True)
        self._thread.start()

    def _run(self, monitors: list[zmq.Socket]) -> None:
        poller = zmq.Poller()
        for monitor in monitors:
            poller.register(monitor, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        stray = {monitor: 0 for monitor in monitors}  # failed handshakes whose DISCONNECTED is due
        try:
            while True:
                ready = dict(poller.poll())
                if ready.get(self._stop_r):
                    return
                for monitor in monitors:
                    if not ready.get(monitor):
                        continue
                    while True:
                        try:
                            parts = monitor.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        event, _ = _EVENT.unpack(parts[0])
                        if event & _HANDSHAKE_FAILED:
                            stray[monitor] += 1
                        elif event == zmq.EVENT_DISCONNECTED:
                            if stray[monitor]:
                                stray[monitor] -= 1
                            else:
                                self._mark_lost()
        except zmq.ZMQError:  # the context is being terminated
            pass
        finally:
            for monitor in monitors:
                monitor.close(linger=0)

    def _mark_lost(self) -> None:
        if not self.lost:
            self.lost = True
            os.write(self._lost_w, b"x")

    def close(self) -> None:
        """Stop the thread (its monitor sockets are closed); call before the context is terminated."""
        if self._thread.is_alive():
            os.write(self._stop_w, b"x")
            self._thread.join()
        self._close_fds()

    def _close_fds(self) -> None:
        for name in ("fd", "_lost_w", "_stop_r", "_stop_w"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)


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
