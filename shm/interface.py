"""What a channel offers, whichever transport carries it.

The shared-memory rings (``shm.channel.Duplex``) and the ZeroMQ baseline
(``shm.zmq_channel.ZmqDuplex``) both implement ``Channel``, so code above
``shm`` (``core.transport``) never asks which one it holds. A message is a
list of frames; every end is used by one thread or task at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from shm.ring import Frame


class SendEnd(Protocol):
    """Counters are totals since the channel was made (metrics read them, never reset them)."""

    waits_for_space: int  # how often a send had to wait for the peer to make room
    messages_sent: int
    bytes_sent: int  # wire bytes: on a ring, records with their headers and padding
    doorbell_rings: int  # wake-up syscalls made for a sleeping consumer

    def try_send(self, frames: Sequence[Frame]) -> bool: ...

    def send(self, frames: Sequence[Frame], timeout: float | None = None) -> None:
        """Wait as needed; TimeoutError after ``timeout`` s, PeerDeadError if the peer is gone."""


class RecvEnd(Protocol):
    messages_received: int
    bytes_received: int
    doorbell_rings: int  # wake-up syscalls made for a producer that waited for space

    def try_recv(self) -> list | None: ...

    def recv(self, timeout: float | None = None) -> list | None:
        """The next message; None after ``timeout`` s; PeerDeadError once drained and the peer is gone."""

    def interrupt(self) -> None:
        """From another thread: a blocked ``recv`` raises ChannelClosed (shutdown)."""


class AsyncSendEnd(Protocol):
    async def send(self, frames: Sequence[Frame]) -> None: ...

    def close(self) -> None:
        """Unregister from the event loop."""


class AsyncRecvEnd(Protocol):
    async def recv(self) -> list: ...

    def close(self) -> None:
        """Unregister from the event loop."""


class Channel(Protocol):
    """Both directions between a creator (frontend) and an attacher (engine)."""

    sender: SendEnd
    receiver: RecvEnd

    def set_peer(self, alive: Callable[[], bool] | None, sentinel: int | None = None) -> None:
        """How to tell the peer process is gone: ``alive()``, and an fd readable once it exits."""

    def peer_attached(self, timeout: float) -> None:
        """Creator side, once the attacher said hello: finish connecting, remove every name."""

    def async_ends(self) -> tuple[AsyncSendEnd, AsyncRecvEnd]:
        """Event-loop ends over the same directions."""

    def unlink(self) -> None: ...

    def close(self) -> None: ...
