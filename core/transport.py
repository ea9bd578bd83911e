"""The frontend <-> EngineCore message transport, one object per side.

A message is a list of frames (``[type, body, aux...]`` towards the engine,
``[body, aux...]`` back). Both sides see the same small interface, so the
engine's busy loop and the clients never know what carries the frames:

- ``ClientTransport`` (frontend): creates the channel, hands its picklable
  spec to the spawned engine, watches the engine process, and offers both
  blocking calls (sync clients, the handshake) and awaitable ones (the
  asyncio client: the doorbells sit in the event loop, no thread).
- ``EngineTransport`` (EngineCore): attaches to the spec; its input thread
  calls ``recv`` and its output thread ``send``, each direction being used
  by exactly one thread.

The shared-memory rings of ``shm/`` are the only transport so far.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from core.config import EngineConfig
from shm.aio import AsyncReceiver, AsyncSender
from shm.channel import ChannelSpec, Duplex, PeerDeadError
from shm.ring import Frame

__all__ = ["ClientTransport", "EngineTransport", "PeerDeadError", "TRANSPORTS"]

TRANSPORTS = ("shm",)
RING_CAPACITY = 1 << 22  # bytes per direction; larger messages are chunked


def _check_kind(kind: str) -> None:
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown transport {kind!r}; available: {', '.join(TRANSPORTS)}")


class ClientTransport:
    """The frontend's end: creator of the channel."""

    def __init__(self, duplex: Duplex) -> None:
        self._duplex = duplex
        self._async_sender: AsyncSender | None = None
        self._async_receiver: AsyncReceiver | None = None

    @classmethod
    def create(cls, config: EngineConfig) -> tuple[ClientTransport, ChannelSpec]:
        """A new channel and the spec the engine process attaches with."""
        _check_kind(config.transport)
        duplex, spec = Duplex.create(RING_CAPACITY)
        return cls(duplex), spec

    def set_peer(self, alive: Callable[[], bool], sentinel: int | None = None) -> None:
        """How to tell the engine is gone: ``alive()`` and an fd readable once it exits."""
        self._duplex.set_peer_alive(alive, sentinel)

    def unlink(self) -> None:
        """Drop the channel's names once the engine has attached (nothing left to leak)."""
        self._duplex.unlink()

    # -------------------------------------------------------------- blocking

    def send(self, frames: Sequence[Frame], timeout: float | None = None) -> None:
        self._duplex.sender.send(frames, timeout)

    def recv(self, timeout: float | None = None) -> list[bytes] | None:
        """The next message; None after ``timeout`` s; PeerDeadError once the engine is gone."""
        return self._duplex.receiver.recv(timeout)

    # -------------------------------------------------------------- asyncio

    async def send_async(self, frames: Sequence[Frame]) -> None:
        if self._async_sender is None:
            self._async_sender = AsyncSender(self._duplex.sender)
        await self._async_sender.send(frames)

    async def recv_async(self) -> list[bytes]:
        if self._async_receiver is None:
            self._async_receiver = AsyncReceiver(self._duplex.receiver)
        return await self._async_receiver.recv()

    def stop_async(self) -> None:
        """Unregister the doorbells from the event loop (call on the loop's thread)."""
        for end in (self._async_sender, self._async_receiver):
            if end is not None:
                end.close()
        self._async_sender = self._async_receiver = None

    def close(self) -> None:
        self.stop_async()
        self._duplex.close()


class EngineTransport:
    """The EngineCore's end: attaches to the frontend's channel and watches the frontend."""

    def __init__(self, duplex: Duplex, sentinel: int | None) -> None:
        self._duplex = duplex
        self._sentinel = sentinel

    @classmethod
    def attach(cls, spec: ChannelSpec, parent_pid: int) -> EngineTransport:
        duplex = Duplex.attach(spec)
        try:
            sentinel: int | None = os.pidfd_open(parent_pid)
        except (AttributeError, OSError):  # not Linux >= 5.3: liveness polling only
            sentinel = None
        duplex.set_peer_alive(lambda: os.getppid() == parent_pid, sentinel)
        return cls(duplex, sentinel)

    def send(self, frames: Sequence[Frame]) -> None:
        """Output thread only. PeerDeadError if the frontend is gone and the ring full."""
        self._duplex.sender.send(frames)

    def recv(self) -> list[bytes]:
        """Input thread only: blocks (without spinning) until a message or the frontend's death."""
        frames = self._duplex.receiver.recv()
        assert frames is not None  # no timeout given
        return frames

    def close(self) -> None:
        self._duplex.close()
        if self._sentinel is not None:
            os.close(self._sentinel)
            self._sentinel = None
