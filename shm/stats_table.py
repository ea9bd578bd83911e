"""A small table of counters in shared memory: one writer per row, any number of readers.

Each row is a sequence word followed by ``width`` signed 64-bit fields and
padded to whole cache lines, so writers of different rows never share a line.
A row's writer makes the sequence odd, stores the fields, then makes it even
again (a seqlock); a reader takes the sequence, the fields, and the sequence
once more, and tries again if it saw an odd value or a change. A reader
therefore never returns a torn row, and a writer never waits for anyone.

A writer can be descheduled between its two sequence updates (on a busy
2-core machine that happens), so a reader that keeps finding the row
mid-write gives its CPU away rather than spinning against it: a few tries,
then ``sched_yield``, then short sleeps. ``try_read`` gives up after the
yields and returns None (a caller with a last good value uses that);
``read`` waits up to a timeout, beyond which the writer has surely died
mid-write (the next writer of the row takes it over).

Ordering: as for the rings' counters (``shm.ring``), every word is accessed as
one item of a memoryview cast to native "q", i.e. one aligned 8-byte move,
and x86-64 keeps stores in program order and loads in program order, which is
all a seqlock needs. The segment follows ``shm.segment``'s rules: a random
0600 name, unlinked by the creator once everyone has attached.
"""

from __future__ import annotations

import mmap
import os
import time

from shm.segment import attach_segment, create_segment, unlink_segment

PREFIX = "ringllm-table-"
MAGIC = 0x5242_4C54_4142_4C45  # "RBLTABLE"
HEADER = 64  # magic, capacity, rows, width
_LINE_WORDS = 8  # a 64-byte cache line of 8-byte words
_SPINS = 8  # tries before a reader starts yielding its CPU to a descheduled writer
_YIELDS = 32  # tries with a sched_yield before each; then try_read gives up
_MAX_NAP_S = 1e-3  # read's longest sleep between tries
READ_TIMEOUT_S = 5.0  # read's patience: far beyond any live writer's pause


class StatsTable:
    """``rows`` rows of ``width`` int64 fields; ``write(row, values)`` and ``read(row)``."""

    def __init__(self, name: str, mm: mmap.mmap, rows: int, width: int, owner: bool) -> None:
        self.name = name
        self.rows = rows
        self.width = width
        self._mm = mm
        self._owner = owner
        self._stride = -(-(width + 1) // _LINE_WORDS) * _LINE_WORDS  # words per row, whole lines
        self._raw = memoryview(mm)
        self._words = self._raw[HEADER:].cast("q")

    @classmethod
    def create(cls, rows: int, width: int) -> StatsTable:
        if rows < 1 or width < 1:
            raise ValueError("a stats table needs at least one row and one field")
        stride = -(-(width + 1) // _LINE_WORDS) * _LINE_WORDS
        name, mm = create_segment(PREFIX, HEADER, rows * stride * 8, MAGIC)
        with memoryview(mm) as raw, raw[16:32].cast("Q") as shape:
            shape[0], shape[1] = rows, width
        return cls(name, mm, rows, width, owner=True)

    @classmethod
    def attach(cls, name: str) -> StatsTable:
        mm, _ = attach_segment(name, PREFIX, HEADER, MAGIC, "stats table")
        with memoryview(mm) as raw, raw[16:32].cast("Q") as shape:
            rows, width = shape[0], shape[1]
        return cls(name, mm, rows, width, owner=False)

    def _base(self, row: int) -> int:
        if not 0 <= row < self.rows:
            raise IndexError(f"row {row} of a {self.rows}-row table")
        return row * self._stride

    def write(self, row: int, values: list[int] | tuple[int, ...]) -> None:
        """Publish a whole row; only one thread of one process may write a given row."""
        base = self._base(row)
        words = self._words
        seq = (words[base] + 1) & ~1  # even, also after a writer that died mid-write
        words[base] = seq + 1  # odd: a write is in progress
        for i, value in enumerate(values[: self.width], base + 1):
            words[i] = value
        words[base] = seq + 2

    def try_read(self, row: int) -> list[int] | None:
        """The row's fields as last published (all zero before the first write), or None
        when the row stayed mid-write through a short wait that yields the CPU."""
        base = self._base(row)
        words = self._words
        end = base + 1 + self.width
        for attempt in range(_SPINS + _YIELDS):
            before = words[base]
            if not before & 1:
                values = words[base + 1 : end].tolist()
                if words[base] == before:
                    return values
            if attempt >= _SPINS:
                os.sched_yield()
        return None

    def read(self, row: int, timeout: float = READ_TIMEOUT_S) -> list[int]:
        """The row's fields as last published; waits while the row is mid-write, sleeping
        between tries, and raises TimeoutError once ``timeout`` has passed (a dead writer)."""
        values = self.try_read(row)
        if values is not None:
            return values
        deadline = time.monotonic() + timeout
        nap = 1e-5
        while (values := self.try_read(row)) is None:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"row {row} of stats table {self.name} stayed mid-write for {timeout} s")
            time.sleep(nap)
            nap = min(2 * nap, _MAX_NAP_S)
        return values

    def version(self, row: int) -> int:
        """How many times the row has been published."""
        return self._words[self._base(row)] // 2

    def unlink(self) -> None:
        if self._owner:
            unlink_segment(self.name)

    def close(self) -> None:
        self.unlink()
        self._words.release()
        self._raw.release()
        self._mm.close()
