"""The frontend <-> EngineCore message transport, one object per side.

A message is a list of frames (``[type, body, aux...]`` towards the engine,
``[body, aux...]`` back). Two transports carry them, chosen with
``--transport``; the engine's busy loop and the clients cannot tell which:

- ``shm`` (default): a pair of shared-memory SPSC rings with doorbells
  (``shm.channel``), plus a shared-memory tensor pool per direction for the
  out-of-band tier of large CPU tensors (``shm.tensors``); CUDA tensors cross
  as CUDA IPC handles whose tickets live in the same pools (``shm.cuda_ipc``).
- ``zmq``: vLLM V1's sockets (ROUTER/DEALER requests, PUSH/PULL outputs,
  tensors as aux frames, CUDA ones copied to the host first), kept as the
  baseline the rings are measured against.

``ClientTransport`` (frontend) creates the channel, hands its picklable spec to
the spawned engine, watches the engine process, and offers blocking calls
(sync clients, the handshake) and awaitable ones (the asyncio client; the
waits sit in the event loop, no thread). ``EngineTransport`` (EngineCore)
attaches to the spec; its input thread calls ``recv`` and its output thread
``send``, so each direction has exactly one user.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from core.protocol import TransportStats
from shm.channel import ChannelSpec, Duplex, ReceiverGroup
from shm.cuda_ipc import CudaIpcExporter, CudaIpcImporter
from shm.interface import AsyncRecvEnd, AsyncSendEnd, Channel
from shm.ring import Frame
from shm.segment import unlink_segment
from shm.tensors import TensorPool, TensorPoolReader, TensorPoolWriter
from shm.waiting import ChannelClosed, PeerDeadError

if TYPE_CHECKING:  # zmq is imported only when that transport is chosen
    from shm.zmq_channel import ZmqChannelSpec

__all__ = [
    "ChannelClosed", "ClientTransport", "EngineInbox", "EngineTransport", "PeerDeadError", "TRANSPORTS", "TransportSpec",
]

TRANSPORTS = ("shm", "zmq")
RING_CAPACITY = 1 << 22  # bytes per direction; larger messages are chunked
# Out-of-band tensor pools. Pages of a shared segment are only backed once
# written, so an unused pool costs address space, not memory.
POOL_TO_ENGINE_BYTES = 256 << 20  # prompt embeddings and other request tensors
POOL_TO_CLIENT_BYTES = 64 << 20  # output tensors


@dataclass(frozen=True)
class TransportSpec:
    """What the spawned engine needs to attach; picklable."""

    kind: str
    channel: Union[ChannelSpec, ZmqChannelSpec]
    to_engine_pool: str | None = None  # segment names (shm only)
    to_client_pool: str | None = None


def _check_kind(kind: str) -> None:
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown transport {kind!r}; available: {', '.join(TRANSPORTS)}")


def _stats(channel: Channel, pool_writer: TensorPoolWriter | None) -> TransportStats:
    """This side's counters; reading them costs the hot path nothing (plain ints)."""
    sender, receiver = channel.sender, channel.receiver
    return TransportStats(
        messages_sent=sender.messages_sent,
        bytes_sent=sender.bytes_sent,
        messages_received=receiver.messages_received,
        bytes_received=receiver.bytes_received,
        oob_bytes_sent=pool_writer.bytes_written if pool_writer is not None else 0,
        ring_full_waits=sender.waits_for_space,
        doorbell_rings=sender.doorbell_rings + receiver.doorbell_rings,
    )


class ClientTransport:
    """The frontend's end: creator of the channel and of the tensor pools."""

    def __init__(
        self,
        kind: str,
        channel: Channel,
        pools: tuple[TensorPool, TensorPool] | None = None,
    ) -> None:
        self.kind = kind
        self._channel = channel
        self._pools = pools
        # Out-of-band tensors: we write the to-engine pool and read the to-client one.
        self.pool_writer = TensorPoolWriter(pools[0]) if pools else None
        self.pool_reader = TensorPoolReader(pools[1]) if pools else None
        # CUDA tensors: IPC handles, with tickets in those pools. Idle unless a
        # CUDA tensor is actually sent (nothing here touches CUDA).
        self.cuda_exporter = CudaIpcExporter(self.pool_writer) if self.pool_writer else None
        self.cuda_importer = CudaIpcImporter(self.pool_reader) if self.pool_reader else None
        self._async_ends: tuple[AsyncSendEnd, AsyncRecvEnd] | None = None

    @classmethod
    def create(cls, kind: str, tcp_host: str | None = None) -> tuple[ClientTransport, TransportSpec]:
        """A new channel of ``kind`` (shm | zmq) and the spec the engine process attaches with.
        ``tcp_host``: zmq over TCP on this address, for an engine on another host."""
        _check_kind(kind)
        if tcp_host is not None and kind != "zmq":
            raise ValueError("only the zmq transport reaches another host")
        if kind == "zmq":
            from shm.zmq_channel import ZmqDuplex

            zduplex, zspec = ZmqDuplex.create(host=tcp_host)
            return cls(kind, zduplex), TransportSpec(kind, zspec)
        duplex, spec = Duplex.create(RING_CAPACITY)
        try:
            to_engine = TensorPool.create(POOL_TO_ENGINE_BYTES)
            try:
                to_client = TensorPool.create(POOL_TO_CLIENT_BYTES)
            except BaseException:
                to_engine.unlink()
                to_engine.close()
                raise
        except BaseException:
            duplex.close()
            raise
        transport = cls(kind, duplex, (to_engine, to_client))
        return transport, TransportSpec(kind, spec, to_engine.name, to_client.name)

    @classmethod
    def adopt(cls, spec: TransportSpec) -> ClientTransport:
        """The frontend's side of a transport another process created (the supervisor of
        several API server processes creates every link and hands each its own)."""
        if spec.kind != "shm" or not (spec.to_engine_pool and spec.to_client_pool):
            raise ValueError("only shm transports can be handed to another frontend process")
        assert isinstance(spec.channel, ChannelSpec)
        duplex = Duplex.attach(spec.channel, creator_side=True)
        try:
            pools = (TensorPool.attach(spec.to_engine_pool), TensorPool.attach(spec.to_client_pool))
        except BaseException:
            duplex.close()
            raise
        return cls(spec.kind, duplex, pools)

    def set_peer(self, alive: Callable[[], bool], sentinel: int | None = None) -> None:
        """How to tell the engine is gone: ``alive()`` and an fd readable once it exits."""
        self._channel.set_peer(alive, sentinel)

    def stats(self) -> TransportStats:
        return _stats(self._channel, self.pool_writer)

    def engine_attached(self, timeout: float) -> None:
        """Call once the engine said HELLO: finish the connection and drop every name,
        so that nothing is left behind even if both processes are killed."""
        self._channel.peer_attached(timeout)
        for pool in self._pools or ():
            pool.unlink()

    # -------------------------------------------------------------- blocking

    def send(self, frames: Sequence[Frame], timeout: float | None = None) -> None:
        self._channel.sender.send(frames, timeout)

    def recv(self, timeout: float | None = None) -> list | None:
        """The next message; None after ``timeout`` s; PeerDeadError once the engine is gone."""
        return self._channel.receiver.recv(timeout)

    # -------------------------------------------------------------- asyncio

    def _ends(self) -> tuple[AsyncSendEnd, AsyncRecvEnd]:
        if self._async_ends is None:
            self._async_ends = self._channel.async_ends()
        return self._async_ends

    async def send_async(self, frames: Sequence[Frame]) -> None:
        await self._ends()[0].send(frames)

    async def recv_async(self) -> list:
        return await self._ends()[1].recv()

    def stop_async(self) -> None:
        """Unregister from the event loop (call on the loop's thread, at shutdown)."""
        for end in self._async_ends or ():
            end.close()
        self._async_ends = None

    def close(self) -> None:
        self.stop_async()
        self._channel.close()
        for pool in self._pools or ():
            pool.unlink()
            pool.close()


class EngineTransport:
    """The EngineCore's end: attaches to the frontend's channel and watches the frontend."""

    def __init__(
        self,
        channel: Channel,
        sentinel: int | None,
        pools: tuple[TensorPool, TensorPool] | None = None,
        kind: str = "shm",
    ) -> None:
        self.kind = kind
        self._channel = channel
        self._sentinel = sentinel
        self._pools = pools
        # We read the to-engine pool and write the to-client one.
        self.pool_reader = TensorPoolReader(pools[0]) if pools else None
        self.pool_writer = TensorPoolWriter(pools[1]) if pools else None
        self.cuda_importer = CudaIpcImporter(self.pool_reader) if self.pool_reader else None
        self.cuda_exporter = CudaIpcExporter(self.pool_writer) if self.pool_writer else None

    @classmethod
    def attach(cls, spec: TransportSpec, parent_pid: int | None, *, child: bool = True) -> EngineTransport:
        """``parent_pid``: the frontend's process, watched (our parent when ``child``; a
        process on this host otherwise). None: a frontend on another host, whose loss
        the TCP connection itself reports."""
        _check_kind(spec.kind)
        pools = None
        if spec.kind == "zmq":
            from shm.zmq_channel import ZmqDuplex

            channel: Channel = ZmqDuplex.attach(spec.channel)
        else:
            # The input thread sleeps on its doorbell rather than spinning: a
            # spinning Python thread takes the GIL from the busy loop's thread.
            channel = Duplex.attach(spec.channel, spin_s=0.0)
            if spec.to_engine_pool and spec.to_client_pool:
                pools = (TensorPool.attach(spec.to_engine_pool), TensorPool.attach(spec.to_client_pool))
        sentinel: int | None = None
        if parent_pid is None:
            channel.set_peer(None)
            return cls(channel, sentinel, pools, spec.kind)
        try:
            sentinel = os.pidfd_open(parent_pid)
        except (AttributeError, OSError):  # not Linux >= 5.3: liveness polling only
            sentinel = None
        if child:
            channel.set_peer(lambda: os.getppid() == parent_pid, sentinel)
        else:
            channel.set_peer(lambda: _process_exists(parent_pid), sentinel)
        return cls(channel, sentinel, pools, spec.kind)

    def stats(self) -> TransportStats:
        return _stats(self._channel, self.pool_writer)

    def send(self, frames: Sequence[Frame]) -> None:
        """Output thread only. PeerDeadError if the frontend is gone and the channel full."""
        self._channel.sender.send(frames)

    def recv(self) -> list:
        """Input thread only: blocks until a message, the frontend's death
        (PeerDeadError) or ``interrupt_recv`` (ChannelClosed)."""
        frames = self._channel.receiver.recv()
        assert frames is not None  # no timeout given
        return frames

    def interrupt_recv(self) -> None:
        """Shutdown: wake the input thread out of ``recv`` so it can exit before ``close``."""
        self._channel.receiver.interrupt()

    def close(self) -> None:
        self._channel.close()
        for pool in self._pools or ():
            pool.close()
        if self._sentinel is not None:
            os.close(self._sentinel)
            self._sentinel = None

    @staticmethod
    def drop_orphaned(spec: TransportSpec) -> None:
        """Remove the names of a shared-memory transport whose frontend died before this engine
        attached (nothing is attached here). The frontend drops them itself once the engine
        says HELLO (ClientTransport.engine_attached): one killed while its engine booted never
        will, and the rings and pools would stay in /dev/shm. (A zmq link's socket files are
        the frontend's to remove.)"""
        if spec.kind != "shm":
            return
        assert isinstance(spec.channel, ChannelSpec)
        spec.channel.unlink()
        for pool in (spec.to_engine_pool, spec.to_client_pool):
            if pool:
                unlink_segment(pool)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EngineInbox:
    """The engine's input thread receiving from every frontend's link at once.

    With one frontend it is that link's ``recv``; with several (one per API
    server process, all over shared-memory rings) one ``ReceiverGroup``
    sleeps on all their doorbells. ``recv`` returns ``(client_index, frames)``:
    the index of the link a message came by, which is the only client index
    the engine trusts.
    """

    def __init__(self, links: Sequence[EngineTransport]) -> None:
        if not links:
            raise ValueError("an engine needs at least one link")
        self._links = list(links)
        self._group: ReceiverGroup | None = None
        if len(links) > 1:
            receivers = [link._channel.receiver for link in links]
            if not all(link.kind == "shm" for link in links):
                raise ValueError("several frontends per engine need the shm transport")
            self._group = ReceiverGroup(receivers)  # type: ignore[arg-type]

    def recv(self) -> tuple[int, list]:
        """Blocks; PeerDeadError once a frontend is gone, ChannelClosed after ``interrupt``."""
        if self._group is None:
            return 0, self._links[0].recv()
        got = self._group.recv()
        assert got is not None  # no timeout given
        return got

    def interrupt(self) -> None:
        if self._group is None:
            self._links[0].interrupt_recv()
        else:
            self._group.interrupt()
