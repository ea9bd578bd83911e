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

Row layout (int64): waiting, running, KV usage in millionths, then one
received count per client index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shm.stats_table import StatsTable

if TYPE_CHECKING:
    from core.sched.scheduler import Scheduler

_FIXED_FIELDS = 3  # waiting, running, kv usage (ppm)
WAITING_WEIGHT = 4  # vLLM's routing score: 4 x waiting + running


@dataclass(frozen=True)
class EngineLoad:
    waiting: int
    running: int
    kv_cache_usage: float
    received: int  # ADDs this engine has taken from the reading client

    def score(self, in_flight: int) -> int:
        """vLLM's rule, with the requests still on their way counted as waiting."""
        return WAITING_WEIGHT * (self.waiting + in_flight) + self.running


def create_load_table(num_engines: int, num_clients: int) -> StatsTable:
    return StatsTable.create(num_engines, _FIXED_FIELDS + num_clients)


class EngineLoadWriter:
    """An engine's side: publishes its own row."""

    def __init__(self, table: StatsTable, engine_index: int) -> None:
        self.table = table
        self.row = engine_index

    @classmethod
    def attach(cls, name: str, engine_index: int) -> EngineLoadWriter:
        return cls(StatsTable.attach(name), engine_index)

    def publish(self, scheduler: Scheduler, received: list[int]) -> None:
        running, waiting = scheduler.get_request_counts()
        usage = int(scheduler.kv_cache_manager.usage * 1_000_000)
        self.table.write(self.row, [waiting, running, usage, *received])

    def close(self) -> None:
        self.table.close()


class EngineLoadReader:
    """A client's side: reads any engine's row as seen by client ``client_index``."""

    def __init__(self, table: StatsTable, client_index: int) -> None:
        if _FIXED_FIELDS + client_index >= table.width:
            raise ValueError(f"client index {client_index} has no column in the load table")
        self.table = table
        self.client_index = client_index

    def read(self, engine_index: int) -> EngineLoad:
        row = self.table.read(engine_index)
        return EngineLoad(row[0], row[1], row[2] / 1_000_000, row[_FIXED_FIELDS + self.client_index])
