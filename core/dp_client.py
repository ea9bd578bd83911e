"""The data-parallel client: several EngineCore processes behind one asyncio client.

``DPAsyncMPClient`` starts ``data_parallel_size`` engines (``data_parallel_rank``
0..N-1), each with its own transport, KV cache share and threads, and looks
like one ``AsyncEngineCoreClient`` to the frontend:

- routing: a request pinned with ``data_parallel_rank`` goes to that engine;
  any other to the engine with the lowest ``4 x waiting + running``, read from
  the shared-memory load table (``core.load``) that every engine updates after
  each step, plus what this client sent it that the figures do not count yet.
  Ties go round robin, so an idle group fills evenly;
- aborts go to the engine that owns the request; utility calls go to every
  serving engine and their results are combined as each utility's
  declaration says (core/utilities.py: counts summed, yes/no questions
  answered by all, lists concatenated);
- failure: an engine that dies fails only its own requests (each ends with
  finish_reason "error" and the reason) and leaves routing; the client is dead
  (``engine_dead``) only when no engine is left. With ``restart_dead_engines``
  a dead engine is started again under the same index and rejoins routing
  once it is ready.

Each engine's outputs carry its ``engine_index``; the metrics label their
series with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any, TypeVar

import msgspec

from core.client import AsyncMPClient, EngineLauncher, MPClient
from core.config import EngineConfig
from core.load import WAITING_WEIGHT, EngineLoadReader, create_load_table
from core.prefix_affinity import PrefixAffinity
from core.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDeadError,
    EngineLostError,
    EngineUnavailableError,
    HandshakeReady,
    TransportStats,
)
from core.transport import TransportSpec
from core.utilities import Call, sum_structs
from shm.stats_table import StatsTable

logger = logging.getLogger("ringllm.dp")

R = TypeVar("R")

# Prefix affinity: a request follows its prefix to an engine with up to this much
# more load than the least loaded one (four more waiting requests).
AFFINITY_SLACK = 4 * WAITING_WEIGHT


@dataclasses.dataclass
class _EngineLost:
    """Queued by an engine's reader when that engine is gone."""

    engine: _DPEngine
    error: BaseException


class _DPEngine(AsyncMPClient):
    """One engine of the group: its outputs and its death go to the group."""

    def __init__(
        self,
        group: DPAsyncMPClient,
        config: EngineConfig,
        load_table: str,
        adopt: tuple[TransportSpec, int] | None = None,
        launcher: EngineLauncher | None = None,
    ) -> None:
        self.group = group
        self.index = config.parallel_config.data_parallel_rank
        self.loss_handled = False
        super().__init__(config, wait=False, load_table=load_table, adopt=adopt, launcher=launcher)

    def detach_from_loop(self) -> None:
        """On the loop's thread: stop reading (before the rest of the shutdown runs elsewhere)."""
        if self._reader_task is not None:
            self._reader_task.cancel()
        self.transport.stop_async()

    def _deliver(self, item: EngineCoreOutputs | Exception) -> None:
        if isinstance(item, Exception):
            self.group._put(_EngineLost(self, item))
        else:
            self.group._put(item)


@dataclasses.dataclass(frozen=True)
class EngineGroupSpec:
    """Engines started by another process (the API servers' supervisor), for one client:
    its client index, the load table's name, and (transport spec, pid) per engine."""

    client_index: int
    load_tables: list[str]  # one per engine
    engines: list[tuple[TransportSpec, int]]


def engine_configs(config: EngineConfig) -> list[EngineConfig]:
    """Each engine's config: its rank, and its share of the cores (unless set)."""
    parallel = config.parallel_config
    size = parallel.data_parallel_size
    threads = parallel.engine_threads or max(1, len(os.sched_getaffinity(0)) // parallel.engines_on_this_host)
    return [
        msgspec.structs.replace(
            config, parallel_config=msgspec.structs.replace(parallel, data_parallel_rank=j, engine_threads=threads)
        )
        for j in range(size)
    ]


class DPAsyncMPClient:
    """N engine processes, one asyncio client (see the module docstring).

    It spawns the engines, or with ``group`` adopts engines another process
    started (one of several API server processes: client index > 0 possible)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        wait: bool = True,
        restart_dead_engines: bool = False,
        group: EngineGroupSpec | None = None,
        launcher: EngineLauncher | None = None,
        prefix_affinity: bool = False,
    ) -> None:
        """``prefix_affinity``: let a request follow its longest prefix already routed to
        an engine that is not much busier than the least loaded (``core.prefix_affinity``)."""
        self.config = config
        self.size = config.parallel_config.data_parallel_size
        if group is not None and restart_dead_engines:
            raise ValueError("engines started by another process are restarted by that process")
        self.restart_dead_engines = restart_dead_engines
        self.launcher = launcher
        self._configs = engine_configs(config)
        if group is None:
            self._loads = EngineLoadReader([create_load_table(num_clients=1) for _ in range(self.size)], 0)
        else:
            self._loads = EngineLoadReader([StatsTable.attach(n) for n in group.load_tables], group.client_index)
        self.engines: list[_DPEngine] = []
        self.engine_dead: EngineDeadError | None = None
        self.ready: HandshakeReady | None = None
        self._routable = [False] * self.size
        self._sent = [0] * self.size  # ADDs sent to each engine (since it started)
        self._owner: dict[str, int] = {}  # unfinished request id -> engine index
        # Engines on another host have no row in the load table: their load is
        # estimated from what was routed there and their last scheduler snapshot.
        self._owned = [0] * self.size
        self._last_running = [0] * self.size
        self._next = 0  # where the next tie-break starts
        self._affinity = PrefixAffinity(config.cache_config.block_size) if prefix_affinity else None
        self._queue: asyncio.Queue[EngineCoreOutputs | _EngineLost | Exception] | None = None
        self._pending: list[EngineCoreOutputs | _EngineLost] = []  # delivered before the loop ran
        self._restarts: set[asyncio.Task] = set()
        self._closing = False
        try:
            for j in range(self.size):
                adopt = group.engines[j] if group is not None else None
                self.engines.append(_DPEngine(self, self._configs[j], self._loads.tables[j].name, adopt, launcher))
            if wait:
                self.wait_ready()
        except BaseException:
            self.shutdown()
            raise

    # ---------------------------------------------------------------- start-up

    def wait_ready(self) -> HandshakeReady:
        """Block until every engine is READY; the group's limits are the first engine's."""
        if self.ready is None:
            for engine in self.engines:
                engine.wait_ready()
            for j in range(self.size):
                self._loads.tables[j].unlink()  # the engine has it open (it is READY): drop the name
                self._routable[j] = True
            first = self.engines[0].ready
            assert first is not None
            self.max_model_len = first.max_model_len
            self.num_gpu_blocks = sum(e.num_gpu_blocks for e in self.engines)
            self.ready = first
        return self.ready

    # ---------------------------------------------------------------- outputs

    def _put(self, item: EngineCoreOutputs | _EngineLost | Exception) -> None:
        if self._queue is None:
            self._pending.append(item)  # type: ignore[arg-type]
        else:
            self._queue.put_nowait(item)

    def _ensure_queue(self) -> asyncio.Queue:
        if self._queue is None:
            self._queue = asyncio.Queue()
            for item in self._pending:
                self._queue.put_nowait(item)
            self._pending.clear()
            for engine in self.engines:
                engine._ensure_reader()
        return self._queue

    async def get_output_async(self) -> EngineCoreOutputs:
        queue = self._ensure_queue()
        while True:
            item = await queue.get()
            if isinstance(item, _EngineLost):
                lost = self._engine_lost(item.engine, item.error)
                if lost is not None:
                    raise lost  # the caller fails these requests and reads on
                continue
            if isinstance(item, Exception):
                queue.put_nowait(item)  # every later caller fails too
                raise item
            owner, owned = self._owner, self._owned
            for output in item.outputs:
                if output.finish_reason is not None:
                    j = owner.pop(output.request_id, None)
                    if j is not None:
                        owned[j] -= 1
            if item.scheduler_stats is not None:
                self._last_running[item.engine_index] = item.scheduler_stats.num_running_reqs
            return item

    def _engine_lost(self, engine: _DPEngine, error: BaseException) -> EngineLostError | None:
        """Take a dead engine out of routing; the error that fails its requests."""
        if engine.loss_handled or self._closing:
            return None
        engine.loss_handled = True
        j = engine.index
        self._routable[j] = False
        ids = [rid for rid, owner in self._owner.items() if owner == j]
        for rid in ids:
            del self._owner[rid]
        self._owned[j] = 0
        if self._affinity is not None:
            self._affinity.forget_engine(j)
        exitcode = engine.proc.exitcode
        logger.error("engine %d died (exit code %s): %s; %d requests failed", j, exitcode, error, len(ids))
        if self.restart_dead_engines and (self.launcher is None or self.launcher.can_restart(j)):
            self._restart(j)
        elif not any(self._routable) and not self._restarts:
            self.engine_dead = EngineDeadError(f"every engine is dead (the last one: {error})")
            assert self._queue is not None
            self._queue.put_nowait(self.engine_dead)  # after these outputs, the output handler stops
        if not ids:
            return None
        return EngineLostError(j, ids, f"engine {j} died while serving this request ({error})")

    def _restart(self, j: int) -> None:
        old = self.engines[j]
        loop = asyncio.get_running_loop()

        async def restart() -> None:
            old.detach_from_loop()
            await loop.run_in_executor(None, MPClient.shutdown, old)  # reaps the process, frees its rings
            self._loads.replace(j, create_load_table(num_clients=1)).close()
            engine = _DPEngine(self, self._configs[j], self._loads.tables[j].name, launcher=self.launcher)
            self.engines[j] = engine
            try:
                await loop.run_in_executor(None, engine.wait_ready)
            except Exception as exc:  # noqa: BLE001 - it stays out of routing; logged
                logger.error("engine %d did not restart: %s", j, exc)
                if not any(self._routable) and len(self._restarts) <= 1 and self._queue is not None:
                    self.engine_dead = EngineDeadError(f"every engine is dead (engine {j} did not restart: {exc})")
                    self._queue.put_nowait(self.engine_dead)
                return
            self._loads.tables[j].unlink()
            if self._closing:
                return
            self._sent[j] = 0  # the new engine's counts start from zero
            engine._ensure_reader()
            self._routable[j] = True
            logger.info("engine %d restarted and serves again", j)

        logger.info("restarting engine %d (--restart-dead-engines)", j)
        task = loop.create_task(restart())
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    # ---------------------------------------------------------------- routing

    def _choose(self, request: EngineCoreRequest) -> int:
        affinity = self._affinity
        if affinity is None:
            return self._least_loaded(request, None)
        keys = affinity.keys(request.prompt_token_ids, request.cache_salt)
        engine = self._least_loaded(request, affinity.lookup(keys)[0] if keys else -1)
        if keys:
            affinity.record(keys, engine)
        return engine

    def _least_loaded(self, request: EngineCoreRequest, preferred: int | None) -> int:
        """The pinned engine, else the least loaded one, else ``preferred`` (>= 0) when its
        score is within AFFINITY_SLACK of the least loaded's."""
        rank = request.data_parallel_rank
        if rank is not None:
            if not 0 <= rank < self.size:
                raise ValueError(f"data_parallel_rank {rank} is not in 0..{self.size - 1}")
            if not self._routable[rank]:
                raise EngineUnavailableError(f"engine {rank} is not serving")
            return rank
        preferred_score = None
        best, best_score = -1, 0
        loads, sent, routable, engines = self._loads, self._sent, self._routable, self.engines
        for k in range(self.size):
            j = (self._next + k) % self.size
            if not routable[j]:
                continue
            if engines[j].remote:
                running = min(self._last_running[j], self._owned[j])
                score = WAITING_WEIGHT * (self._owned[j] - running) + running
            else:
                load = loads.read(j)
                score = load.score(sent[j] - load.received)
            if best < 0 or score < best_score:
                best, best_score = j, score
            if j == preferred:
                preferred_score = score
        if best < 0:
            raise EngineUnavailableError("no engine is serving")
        if preferred_score is not None and preferred_score <= best_score + AFFINITY_SLACK:
            return preferred  # type: ignore[return-value]
        self._next = (best + 1) % self.size
        return best

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._ensure_queue()
        if self.engine_dead is not None:
            raise self.engine_dead
        j = self._choose(request)
        self._owner[request.request_id] = j
        self._owned[j] += 1
        self._sent[j] += 1
        try:
            await self.engines[j].add_request_async(request)
        except EngineDeadError:
            # It died under us; its loss, handled by the output handler, fails the request.
            pass

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            j = self._owner.pop(rid, None)
            if j is not None:
                self._owned[j] -= 1
                by_engine.setdefault(j, []).append(rid)
        for j, ids in by_engine.items():
            if self._routable[j]:
                try:
                    await self.engines[j].abort_requests_async(ids)
                except EngineDeadError:
                    pass  # its requests are failed with it

    async def call_async(self, call: Call[R]) -> R:
        """Every serving engine's result, combined as the utility declares."""
        self._ensure_queue()
        serving = [e for j, e in enumerate(self.engines) if self._routable[j]]
        if not serving:
            raise self.engine_dead or EngineUnavailableError("no engine is serving")
        results = await asyncio.gather(*(e.call_async(call) for e in serving))
        return call.utility.combine(list(results))

    async def call_each_async(self, call: Call[R]) -> list[R | None]:
        async def one(j: int) -> R | None:
            if not self._routable[j]:
                return None
            try:
                return await self.engines[j].call_async(call)
            except EngineDeadError:
                return None

        return list(await asyncio.gather(*(one(j) for j in range(self.size))))

    # ---------------------------------------------------------------- status

    def engines_alive(self) -> list[bool]:
        """Per engine index: is it serving (a restarting engine is not yet)."""
        return list(self._routable)

    def is_gone(self) -> bool:
        """No engine will serve again (a restarting one will)."""
        return self.engine_dead is not None

    def engine_processes(self) -> list[Any]:
        return [e.proc for e in self.engines]

    def transport_stats(self) -> TransportStats | None:
        """This side's counters, summed over the engines' transports."""
        return sum_structs([e.transport.stats() for e in self.engines]) if self.engines else None

    def kill_now(self) -> None:
        self._closing = True
        for engine in self.engines:
            engine.kill_now()
        self._loads.close()

    def shutdown(self) -> None:
        if self._closing and not self.engines:
            return
        self._closing = True
        for task in self._restarts:
            task.cancel()
        for engine in self.engines:
            engine.shutdown()
        self.engines = []
        if self.launcher is not None:
            self.launcher.shutdown()
        self._loads.close()
