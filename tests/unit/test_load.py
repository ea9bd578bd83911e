"""Data-parallel load rows as routing reads them: a row caught mid-write never fails a request."""

from __future__ import annotations

from core.load import EngineLoad, EngineLoadReader, create_load_table


def test_a_row_mid_write_reads_as_its_last_good_value() -> None:
    tables = [create_load_table(num_clients=2) for _ in range(2)]
    reader = EngineLoadReader(tables, client_index=1)
    try:
        assert reader.read(0) == EngineLoad(0, 0, 0.0, 0)  # nothing published yet
        tables[0].write(0, [3, 2, 250_000, 7, 9])
        assert reader.read(0) == EngineLoad(waiting=3, running=2, kv_cache_usage=0.25, received=9)

        tables[0]._words[0] += 1  # its engine is rewriting the row (or died doing so)
        assert reader.read(0) == EngineLoad(3, 2, 0.25, 9)  # at once, no error
        tables[0].write(0, [1, 1, 0, 7, 10])  # the next write takes the row over
        assert reader.read(0) == EngineLoad(1, 1, 0.0, 10)

        tables[1]._words[0] += 1  # never read well: counts as idle until it is
        assert reader.read(1) == EngineLoad(0, 0, 0.0, 0)
    finally:
        reader.close()
