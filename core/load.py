"""Data-parallel load figures: each engine's row in a shared-memory table.

Every engine publishes, after each step and before it sleeps, how many
requests it has waiting and running, its KV cache usage, and how many ADDs
it has taken from each client so far. A client (one per API server process)
reads the rows directly when it routes a request: the figures are as fresh as
the engine's last step, where vLLM's coordinator republishes them at most
every 100 ms. The client also knows how many requests it has sent to each
engine; the difference with the engine's "taken from me" count is what is
still on its way, so a burst sent between two steps spreads evenly instead
of piling onto the engine that looked idle.

Each engine has a table of its own, one row (int64): waiting, running, KV usage
in millionths, then one received count per client index. Its own, so that its
name can be dropped as soon as that engine has attached (it is READY), and a
restarted engine gets a fresh one: nothing is left in /dev/shm whichever
process is killed.

Routing never waits on a row: one that its engine is rewriting at that very
moment (or was descheduled while rewriting) is taken as it last read well,
a step old at most; a request is never failed or held for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shm.stats_table import StatsTable

if TYPE_CHECKING:
    from core.sched.scheduler import Scheduler

_FIXED_FIELDS = 3  # waiting, running, kv usage (ppm)
WAITING_WEIGHT = 4  # vLLM's routing score: 4 x waiting + running
_NO_READING_YET = (0, 0, 0, 0)


@dataclass(frozen=True)
class EngineLoad:
    waiting: int
    running: int
    kv_cache_usage: float
    received: int  # ADDs this engine has taken from the reading client

    def score(self, in_flight: int) -> int:
        """vLLM's rule, with the requests still on their way counted as waiting."""
        return WAITING_WEIGHT * (self.waiting + in_flight) + self.running


def create_load_table(num_clients: int) -> StatsTable:
    """One engine's table, with a received count for each of ``num_clients`` clients."""
    return StatsTable.create(1, _FIXED_FIELDS + num_clients)


class EngineLoadWriter:
    """An engine's side: publishes its row."""

    def __init__(self, table: StatsTable) -> None:
        self.table = table

    @classmethod
    def attach(cls, name: str) -> EngineLoadWriter:
        return cls(StatsTable.attach(name))

    def publish(self, scheduler: Scheduler, received: list[int]) -> None:
        running, waiting = scheduler.get_request_counts()
        usage = int(scheduler.kv_cache_manager.usage * 1_000_000)
        self.table.write(0, [waiting, running, usage, *received])

    def close(self) -> None:
        self.table.close()


class EngineLoadReader:
    """A client's side: every engine's table, read as client ``client_index`` sees them."""

    def __init__(self, tables: list[StatsTable], client_index: int) -> None:
        self.tables = tables  # by engine index; a restarted engine's replaces its predecessor's
        self.client_index = client_index
        for table in tables:
            self._check(table)
        self._last = [EngineLoad(*_NO_READING_YET)] * len(tables)  # the last good read, per engine

    def _check(self, table: StatsTable) -> None:
        if _FIXED_FIELDS + self.client_index >= table.width:
            raise ValueError(f"client index {self.client_index} has no column in load table {table.name}")

    def replace(self, engine_index: int, table: StatsTable) -> StatsTable:
        """A new table for that engine; returns the old one (to close)."""
        self._check(table)
        old, self.tables[engine_index] = self.tables[engine_index], table
        self._last[engine_index] = EngineLoad(*_NO_READING_YET)
        return old

    def read(self, engine_index: int) -> EngineLoad:
        """The engine's figures; its last good ones while the engine is rewriting them."""
        row = self.tables[engine_index].try_read(0)
        if row is None:
            return self._last[engine_index]
        load = EngineLoad(row[0], row[1], row[2] / 1_000_000, row[_FIXED_FIELDS + self.client_index])
        self._last[engine_index] = load
        return load

    def close(self) -> None:
        for table in self.tables:
            table.close()
