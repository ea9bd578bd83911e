"""The shared-memory stats table: a reader in this process never sees a torn row while
a writer in another process rewrites it as fast as it can."""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from shm.stats_table import StatsTable


def _writer(name: str, row: int, rounds: int) -> None:
    table = StatsTable.attach(name)
    for i in range(1, rounds + 1):
        table.write(row, [i] * table.width)  # every field equal: a torn row shows it
    table.close()


def test_rows_are_never_torn_across_processes() -> None:
    table = StatsTable.create(rows=2, width=5)
    try:
        ctx = multiprocessing.get_context("spawn")
        writer = ctx.Process(target=_writer, args=(table.name, 1, 200_000))
        writer.start()
        seen = set()
        while writer.is_alive() or not seen:
            row = table.read(1)
            assert len(set(row)) == 1, row
            seen.add(row[0])
            assert table.read(0) == [0] * 5  # the neighbour row is untouched
        writer.join()
        assert writer.exitcode == 0
        assert table.read(1) == [200_000] * 5
        assert len(seen) > 10  # the reads overlapped the writes
        assert table.version(1) == 200_000
    finally:
        table.close()


def test_a_row_left_mid_write_is_taken_over_by_the_next_writer() -> None:
    table = StatsTable.create(rows=1, width=2)
    try:
        table._words[0] = 7  # a writer died between its two sequence updates
        assert table.try_read(0) is None
        with pytest.raises(TimeoutError):
            table.read(0, timeout=0.05)
        table.write(0, [3, 4])
        assert table.read(0) == [3, 4]
    finally:
        table.close()


def test_attach_checks_the_segment() -> None:
    with pytest.raises(ValueError):
        StatsTable.attach("ringllm-ring-0000")
    table = StatsTable.create(rows=3, width=9)
    try:
        other = StatsTable.attach(table.name)
        assert (other.rows, other.width) == (3, 9)
        table.write(2, list(range(9)))
        assert other.read(2) == list(range(9))
        with pytest.raises(IndexError):
            other.read(3)
        other.close()
    finally:
        table.close()


def test_a_reader_waits_out_a_writer_paused_mid_write() -> None:
    """A writer descheduled between its sequence updates (as on a loaded machine) delays a
    reader; it does not fail it."""
    table = StatsTable.create(rows=1, width=3)
    try:
        table.write(0, [1, 2, 3])
        seq = table._words[0]
        table._words[0] = seq + 1  # mid-write, as a writer that lost its CPU leaves it
        resumed = threading.Timer(0.2, lambda: table.write(0, [4, 5, 6]))
        resumed.start()
        assert table.read(0) == [4, 5, 6]
        resumed.join()
    finally:
        table.close()
