"""Doorbells: a one-byte wake-up between two unrelated processes.

A doorbell is a named FIFO that both processes open ``O_RDWR | O_NONBLOCK``.
Opening read-write means neither ``open`` nor ``write`` ever blocks or fails
for want of a peer, and the FIFO's fd can be handed to ``poll`` or to an
event loop's ``add_reader``. Once both sides hold it open the name is unlinked
(``unlink``), so nothing is left on disk even if both processes are killed.

The FIFO carries no data: a byte means "look at the ring". The rings ring a
doorbell only when the other side said it sleeps, so there are few bytes, and
a full FIFO (EAGAIN) simply means it has already been rung.
"""

from __future__ import annotations

import os


class Doorbell:
    """One FIFO, opened read-write and non-blocking."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def create(cls, directory: str, name: str) -> Doorbell:
        """Make a FIFO (mode 0600) in ``directory``, which should be private (0700)."""
        path = os.path.join(directory, name)
        os.mkfifo(path, 0o600)
        return cls.open(path)

    @classmethod
    def open(cls, path: str) -> Doorbell:
        return cls(path, os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC))

    def fileno(self) -> int:
        return self._fd

    def ring(self) -> None:
        try:
            os.write(self._fd, b"\0")
        except BlockingIOError:
            pass  # the FIFO is full: it has been rung plenty

    def drain(self) -> None:
        """Consume pending rings, so that the next wait blocks."""
        try:
            while len(os.read(self._fd, 4096)) == 4096:
                pass
        except BlockingIOError:
            pass

    def unlink(self) -> None:
        """Remove the FIFO's name; both open fds keep working."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
