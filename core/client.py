"""Engine clients: how the frontend reaches an EngineCore.

Two interfaces, as in vLLM V1: ``EngineCoreClient`` (blocking) and
``AsyncEngineCoreClient`` (asyncio), whose utility calls (``call``,
``call_async``) take the declarations of core/utilities.py. Implementations:

- ``InprocClient``: the EngineCore lives in this process; ``get_output`` drives
  it (the offline ``LLM`` class).
- ``AsyncInprocClient``: the EngineCore in this process, driven by a task on
  the event loop (tests of the HTTP layer against the real engine, no IPC).
- ``SyncMPClient``: spawned EngineCore process; a reader thread collects outputs.
- ``AsyncMPClient``: spawned EngineCore process; outputs are read on the event
  loop (the transport's doorbell is registered with ``loop.add_reader``).

Every multi-process client watches its engine: a dead process or an
ENGINE_CORE_DEAD message turns into ``EngineDeadError`` for every waiter.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import multiprocessing
import os
import queue
import select
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

import msgspec

from core.config import EngineConfig
from core.engine_process import run_engine_process
from core.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineDeadError,
    EngineStartError,
    FinishReason,
    HandshakeReady,
    TransportStats,
    UtilityOutput,
    finished_outputs,
)
from core.transport import ClientTransport, PeerDeadError, TransportSpec
from core.utilities import Call, Utility, UtilityCall, encode_call
from shm.serial import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger("ringllm.client")

STARTUP_TIMEOUT_S = 300.0
GRAMMAR_POLL_S = 0.05  # an offline driver's longest wait for a compiling grammar

R = TypeVar("R")


def spawn_engine(
    config: EngineConfig, specs: list[TransportSpec], load_table: str | None = None
) -> multiprocessing.process.BaseProcess:
    """An EngineCore process (not started yet) with one link per frontend in ``specs``."""
    parallel = config.parallel_config
    name = f"EngineCore_DP{parallel.data_parallel_rank}" if parallel.data_parallel_size > 1 else "EngineCore"
    ctx = multiprocessing.get_context("spawn")
    return ctx.Process(
        target=run_engine_process, args=(config, specs, os.getpid(), load_table), name=name, daemon=True
    )


class EngineCoreClient(Protocol):
    """A blocking handle on one EngineCore."""

    max_model_len: int
    num_gpu_blocks: int

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def get_output(self) -> EngineCoreOutputs: ...

    def call(self, call: Call[R]) -> R:
        """A utility call (core/utilities.py); RuntimeError when the engine refused it."""

    def shutdown(self) -> None: ...


class AsyncEngineCoreClient(Protocol):
    """An asyncio handle on one EngineCore; ``engine_dead`` is set once it is gone."""

    max_model_len: int
    num_gpu_blocks: int
    engine_dead: EngineDeadError | None

    async def add_request_async(self, request: EngineCoreRequest) -> None: ...

    async def abort_requests_async(self, request_ids: list[str]) -> None: ...

    async def get_output_async(self) -> EngineCoreOutputs: ...

    async def call_async(self, call: Call[R]) -> R:
        """A utility call (core/utilities.py); with several engines, their results combined."""

    async def call_each_async(self, call: Call[R]) -> list[R | None]:
        """The call's result from each engine index (None for an engine that is down)."""

    def transport_stats(self) -> TransportStats | None:
        """This side's transport counters; None when the engine is in this process."""

    def engines_alive(self) -> list[bool]:
        """Per engine index: is it serving."""

    def shutdown(self) -> None: ...


@contextlib.contextmanager
def _as_utility_failure(utility: Utility[Any]) -> Iterator[None]:
    """In-process utility errors, raised as an engine process's reply raises them."""
    try:
        yield
    except Exception as exc:
        raise RuntimeError(f"utility {utility.name!r} failed: {exc}") from exc


class InprocClient:
    """No IPC: for tests and the offline ``LLM`` class. ``get_output`` drives the
    engine one turn at a time (``EngineCore.run_once``)."""

    def __init__(self, config: EngineConfig) -> None:
        from core.engine_core import EngineCore  # the engine itself: torch, the model

        self.engine_core = EngineCore(config)
        self.max_model_len = self.engine_core.config.max_model_len
        self.num_gpu_blocks = self.engine_core.num_gpu_blocks
        self._ready: collections.deque[EngineCoreOutputs] = collections.deque()
        self._grammar_ready = threading.Event()
        self.engine_core.set_waker(self._grammar_ready.set)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(self.engine_core.preprocess_add_request(request))

    def _turn(self) -> None:
        engine = self.engine_core
        if engine.is_idle() and engine.has_compiling_grammars():
            self._grammar_ready.wait(GRAMMAR_POLL_S)
            self._grammar_ready.clear()
        self._ready.extend(outputs for _, outputs in engine.run_once())

    def get_output(self) -> EngineCoreOutputs:
        """The next outputs; empty ones when a turn of the engine made none."""
        if not self._ready:
            self._turn()
        return self._ready.popleft() if self._ready else EngineCoreOutputs()

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def call(self, call: Call[R]) -> R:
        """A call that waits for the engine to be idle (pause "wait") drives it until
        then; the outputs of those turns are kept for ``get_output``. Failures are
        RuntimeErrors, as from an engine process."""
        with _as_utility_failure(call.utility):
            result = self.engine_core.call_utility(call.utility, call.args)
            if not isinstance(result, Future):
                return result
            while not result.done():
                self._turn()
            return result.result()

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class AsyncInprocClient:
    """The EngineCore in this process, driven by a task on the running event loop.

    Each turn runs on the loop itself (it blocks the loop for the step's
    duration) and the task yields between turns, so requests, aborts and
    consumers interleave with the engine exactly at step boundaries, where
    the input thread of a real engine process would hand them over. A step
    that raises kills the engine, as in a separate process: every waiter gets
    EngineDeadError.
    """

    def __init__(self, config: EngineConfig) -> None:
        from core.engine_core import EngineCore  # the engine itself: torch, the model

        self.engine_core = EngineCore(config)
        self.max_model_len = self.engine_core.config.max_model_len
        self.num_gpu_blocks = self.engine_core.num_gpu_blocks
        self.engine_dead: EngineDeadError | None = None
        self._outputs: asyncio.Queue[EngineCoreOutputs | Exception] | None = None
        self._has_work: asyncio.Event | None = None
        self._driver: asyncio.Task | None = None

    def _start(self) -> tuple[asyncio.Queue, asyncio.Event]:
        if self._driver is None:
            self._outputs = asyncio.Queue()
            self._has_work = has_work = asyncio.Event()
            loop = asyncio.get_running_loop()
            self._driver = loop.create_task(self._run())

            def wake() -> None:  # from a grammar-compiling thread
                with contextlib.suppress(RuntimeError):  # the loop is gone: nobody to wake
                    loop.call_soon_threadsafe(has_work.set)

            self.engine_core.set_waker(wake)
        assert self._outputs is not None and self._has_work is not None
        return self._outputs, self._has_work

    async def _run(self) -> None:
        outputs, has_work = self._start()
        engine = self.engine_core
        while True:
            if engine.is_idle():
                has_work.clear()
                await has_work.wait()
                continue
            try:
                ready = engine.run_once()
            except Exception as exc:  # noqa: BLE001 - the engine is dead, as a crashed process would be
                logger.error("in-process EngineCore failed", exc_info=exc)
                self.engine_dead = EngineDeadError(f"EngineCore hit a fatal error: {exc!r}")
                outputs.put_nowait(self.engine_dead)
                return
            for _, out in ready:
                if out.outputs or out.scheduler_stats is not None:
                    outputs.put_nowait(out)
            await asyncio.sleep(0)

    def _check_alive(self) -> None:
        if self.engine_dead is not None:
            raise self.engine_dead

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        outputs, has_work = self._start()
        self._check_alive()
        try:
            self.engine_core.add_request(self.engine_core.preprocess_add_request(request))
        except ValueError as exc:
            outputs.put_nowait(finished_outputs([request.request_id], FinishReason.ERROR, str(exc)))
            return
        has_work.set()

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self._check_alive()
        self.engine_core.abort_requests(request_ids)
        self._start()[1].set()  # the runner must hear of it at the next step

    async def get_output_async(self) -> EngineCoreOutputs:
        outputs, _ = self._start()
        item = await outputs.get()
        if isinstance(item, Exception):
            outputs.put_nowait(item)  # every later caller fails too
            raise item
        return item

    async def call_async(self, call: Call[R]) -> R:
        self._check_alive()
        _, has_work = self._start()
        with _as_utility_failure(call.utility):
            result = self.engine_core.call_utility(call.utility, call.args)
            # The call may have made work (resume), outputs (a pause's aborts) or wait
            # for idleness: the driver sees to all of them once woken.
            has_work.set()
            if isinstance(result, Future):
                return await asyncio.wrap_future(result)
            return result

    async def call_each_async(self, call: Call[R]) -> list[R | None]:
        return [await self.call_async(call)]

    def transport_stats(self) -> TransportStats | None:
        return None

    def engines_alive(self) -> list[bool]:
        return [self.engine_dead is None]

    def shutdown(self) -> None:
        if self._driver is not None:
            self._driver.cancel()
        self.engine_core.shutdown()


class ForeignEngineProcess:
    """An engine process that another process started (the supervisor of several API
    server processes): watched through a pidfd, never signalled or reaped from here."""

    exitcode: int | None = None

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.sentinel = os.pidfd_open(pid)  # readable once the process has exited

    def is_alive(self) -> bool:
        return not select.select([self.sentinel], [], [], 0)[0]

    def terminate(self) -> None:
        """Its owner stops it."""

    def kill(self) -> None:
        """Its owner stops it."""

    def join(self, timeout: float | None = None) -> None:
        """Its owner reaps it."""


class EngineLauncher(Protocol):
    """Starts engines that are not children of this process (``core.ray_engines``)."""

    frontend_host: str  # this host's address, for engines elsewhere to connect to

    def is_local(self, engine_index: int) -> bool:
        """Whether that engine runs on this host (shared-memory rings) or elsewhere (TCP)."""

    def launch(self, config: EngineConfig, spec: TransportSpec, load_table: str | None) -> Any:
        """Start the engine; a handle with ``is_alive``, ``sentinel``, ``exitcode``,
        ``terminate``, ``kill`` and ``join`` as a multiprocessing Process has."""

    def can_restart(self, engine_index: int) -> bool:
        """Whether a dead engine of that index can be started again from here."""

    def shutdown(self) -> None:
        """Release what was reserved for the engines (they are stopped already)."""


class MPClient:
    """Spawns the EngineCore process, runs the handshake, owns the transport.

    With ``wait=False`` the constructor returns as soon as the process is
    started, and ``wait_ready()`` completes the handshake later: the caller
    can do its own start-up while the engine boots.

    Utility calls wait on a future (thread or asyncio) per ``call_id``; the
    reply's result is decoded as the type its method declares.
    """

    ready: HandshakeReady | None = None  # what the engine reported: KV cache size, dtype, device
    remote = False  # on another host: no load table, TCP transport

    def __init__(
        self,
        config: EngineConfig,
        *,
        wait: bool = True,
        load_table: str | None = None,
        adopt: tuple[TransportSpec, int] | None = None,
        launcher: EngineLauncher | None = None,
    ) -> None:
        """``load_table``: the data-parallel load table the engine publishes its row in.
        ``adopt``: (transport spec, pid) of an engine another process started, over a
        transport it created for us: nothing is spawned. ``launcher``: start the engine
        through it (Ray) instead of as a child; one on another host is reached over TCP
        and gets no load table (shared memory does not reach it)."""
        self.config = config
        if adopt is not None:
            spec, pid = adopt
            self.transport = ClientTransport.adopt(spec)
            self.proc: Any = ForeignEngineProcess(pid)
        elif launcher is not None:
            self.remote = not launcher.is_local(self.config.parallel_config.data_parallel_rank)
            if self.remote:
                self.transport, spec = ClientTransport.create("zmq", tcp_host=launcher.frontend_host)
            else:
                self.transport, spec = ClientTransport.create(self.config.transport)
            try:
                self.proc = launcher.launch(self.config, spec, None if self.remote else load_table)
            except BaseException:
                self.transport.close()
                raise
        else:
            self.transport, spec = ClientTransport.create(self.config.transport)
        # Large request tensors go out of band through the transport's pool,
        # CUDA ones as IPC handles (shm only).
        self.encoder = MsgpackEncoder(pool=self.transport.pool_writer, cuda_ipc=self.transport.cuda_exporter)
        self.decoder = MsgpackDecoder(
            EngineCoreOutputs, pool=self.transport.pool_reader, cuda_ipc=self.transport.cuda_importer
        )
        if adopt is None and launcher is None:
            self.proc = spawn_engine(self.config, [spec], load_table)
            try:
                self.proc.start()
            except BaseException:
                self.transport.close()  # nobody will attach: remove the segments now
                raise
        self.transport.set_peer(self.proc.is_alive, self.proc.sentinel)
        self.engine_dead: EngineDeadError | None = None
        self._closing = False  # set by shutdown(): the engine's exit is expected
        self._call_ids = itertools.count()
        self._pending_utilities: dict[int, tuple[Future | asyncio.Future, Any]] = {}
        if wait:
            self.wait_ready()

    def wait_ready(self) -> HandshakeReady:
        """Block until the engine is READY (at once if it already was)."""
        if self.ready is None:
            try:
                ready = self._handshake()
            except BaseException:
                self._stop_process()
                self.transport.close()
                raise
            self.num_gpu_blocks = ready.num_gpu_blocks
            self.max_model_len = ready.max_model_len
            self.ready = ready
        return self.ready

    def _handshake(self) -> HandshakeReady:
        """HELLO when the engine attached to the transport, READY once it can serve."""
        for expected in (b"HELLO", b"READY"):
            try:
                frames = self.transport.recv(timeout=STARTUP_TIMEOUT_S)
            except PeerDeadError:
                raise EngineStartError(
                    f"EngineCore process exited during start-up (exit code {self.proc.exitcode})"
                ) from None
            if frames is None:
                step = "attach to its transport" if expected == b"HELLO" else "load its model"
                raise EngineStartError(f"EngineCore did not {step} within {STARTUP_TIMEOUT_S:.0f} s")
            if bytes(frames[0]) == ENGINE_CORE_DEAD:
                raise EngineStartError(bytes(frames[1]).decode() if len(frames) > 1 else "EngineCore died")
            if bytes(frames[0]) != expected:
                raise RuntimeError(f"handshake: expected {expected!r}, got {bytes(frames[0])[:32]!r}")
            if expected == b"HELLO":
                # Both sides hold the channel: drop its names now, so that nothing
                # is left in /dev/shm even if both processes are killed.
                self.transport.engine_attached(timeout=STARTUP_TIMEOUT_S)
        return msgspec.msgpack.decode(frames[1], type=HandshakeReady)

    def _decode_outputs(self, frames: list) -> EngineCoreOutputs:
        if bytes(frames[0]) == ENGINE_CORE_DEAD:
            detail = bytes(frames[1]).decode() if len(frames) > 1 else ""
            raise EngineDeadError(f"EngineCore died: {detail}".rstrip(": "))
        return self.decoder.decode(frames)

    def _utility_call(self, call: Call[Any], future: Future | asyncio.Future) -> UtilityCall:
        """Register ``future`` for the reply; the UTILITY payload to send."""
        call_id = next(self._call_ids)
        self._pending_utilities[call_id] = (future, call.utility.result)
        return encode_call(call, call_id)

    def _utility_done(self, out: UtilityOutput) -> None:
        pending = self._pending_utilities.pop(out.call_id, None)
        if pending is None or pending[0].done():
            return
        future, result_type = pending
        if out.failure_message is not None:
            future.set_exception(RuntimeError(out.failure_message))
        else:
            try:
                future.set_result(msgspec.msgpack.decode(out.result, type=result_type))
            except msgspec.DecodeError as exc:
                future.set_exception(exc)

    def _deliver(self, item: EngineCoreOutputs | Exception) -> None:
        """Hand outputs (or the engine's death) to whoever calls get_output."""
        raise NotImplementedError

    def _on_frames(self, frames: list) -> None:
        """One message from the engine: a utility reply or a step's outputs."""
        outputs = self._decode_outputs(frames)
        if outputs.utility_output is not None:
            self._utility_done(outputs.utility_output)
        else:
            self._deliver(outputs)

    def _on_reader_failure(self, exc: BaseException) -> None:
        """The transport or the engine is gone: fail everything that waits."""
        dead = self._mark_dead(exc)
        self._fail_utilities(dead)
        self._deliver(dead)

    def _fail_utilities(self, exc: BaseException) -> None:
        for future, _ in self._pending_utilities.values():
            if not future.done():
                future.set_exception(exc)
        self._pending_utilities.clear()

    def _frames(self, request_type: EngineCoreRequestType, payload: Any) -> list:
        """[type byte, msgpack body, aux frames...]; not thread-safe (the encoder is not)."""
        return [request_type.value, *self.encoder.encode(payload)]

    def _mark_dead(self, exc: BaseException) -> EngineDeadError:
        if self.engine_dead is None:
            if self._closing:
                self.engine_dead = EngineDeadError("the engine client was shut down")
                return self.engine_dead
            self.engine_dead = exc if isinstance(exc, EngineDeadError) else EngineDeadError(
                f"EngineCore process died (exit code {self.proc.exitcode})"
            )
            logger.error("%s", self.engine_dead)
        return self.engine_dead

    def _stop_process(self) -> None:
        """SIGTERM (the engine drains briefly), then SIGKILL if it lingers."""
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=self.config.engine_drain_timeout + 5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)

    def shutdown(self) -> None:
        """Stop the engine and free the transport; later calls do nothing."""
        if self._closing:
            return
        self._closing = True
        self._stop_process()
        self._join_reader()
        self.transport.close()

    def _join_reader(self) -> None:
        """Wait for whatever reads the transport to stop (it sees the engine exit)."""

    def engine_processes(self) -> list[multiprocessing.process.BaseProcess]:
        return [self.proc]

    def engines_alive(self) -> list[bool]:
        """Per engine index: is it serving (here, the one engine)."""
        return [not self.is_gone()]

    def is_gone(self) -> bool:
        """No engine will serve again."""
        return self.engine_dead is not None or not self.proc.is_alive()

    def kill_now(self) -> None:
        """No drain, no goodbye (a second SIGINT): kill the engine, free the transport."""
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=2)
        self.transport.close()

    def transport_stats(self) -> TransportStats | None:
        return self.transport.stats()


class SyncMPClient(MPClient):
    """Blocking client: a reader thread feeds outputs and utility replies."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.outputs_queue: queue.Queue[EngineCoreOutputs | Exception] = queue.Queue()
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_outputs, name="EngineCoreOutputReader", daemon=True)
        self._reader.start()

    def _join_reader(self) -> None:
        self._reader.join(timeout=5)

    def _deliver(self, item: EngineCoreOutputs | Exception) -> None:
        self.outputs_queue.put(item)

    def _read_outputs(self) -> None:
        while True:
            try:
                self._on_frames(self.transport.recv())
            except (PeerDeadError, EngineDeadError, OSError, ValueError) as exc:
                self._on_reader_failure(exc)
                return

    def _send(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        if self.engine_dead is not None:
            raise self.engine_dead
        with self._send_lock:
            try:
                self.transport.send(self._frames(request_type, payload))
            except PeerDeadError as exc:
                raise self._mark_dead(exc) from None

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(EngineCoreRequestType.ABORT, request_ids)

    def get_output(self) -> EngineCoreOutputs:
        item = self.outputs_queue.get()
        if isinstance(item, Exception):
            self.outputs_queue.put(item)  # every later caller fails too
            raise item
        return item

    def call(self, call: Call[R]) -> R:
        future: Future = Future()
        self._send(EngineCoreRequestType.UTILITY, self._utility_call(call, future))
        return future.result()


class AsyncMPClient(MPClient):
    """asyncio client: outputs are read on the loop, without a thread. The queue,
    the reader task and the send lock are made on the loop, at first use."""

    outputs_queue: asyncio.Queue[EngineCoreOutputs | Exception] | None = None
    _reader_task: asyncio.Task | None = None
    _send_lock: asyncio.Lock | None = None

    def _ensure_reader(self) -> None:
        if self._reader_task is None:
            self.outputs_queue = asyncio.Queue()
            self._send_lock = asyncio.Lock()
            self._reader_task = asyncio.get_running_loop().create_task(self._read_outputs())

    def _deliver(self, item: EngineCoreOutputs | Exception) -> None:
        assert self.outputs_queue is not None
        self.outputs_queue.put_nowait(item)

    async def _read_outputs(self) -> None:
        while True:
            try:
                self._on_frames(await self.transport.recv_async())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - whatever broke, the engine is unreachable
                self._on_reader_failure(exc)
                return

    async def _send(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        self._ensure_reader()
        if self.engine_dead is not None:
            raise self.engine_dead
        assert self._send_lock is not None
        async with self._send_lock:  # keeps message order when a send has to wait
            try:
                await self.transport.send_async(self._frames(request_type, payload))
            except PeerDeadError as exc:
                raise self._mark_dead(exc) from None

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._send(EngineCoreRequestType.ABORT, request_ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_reader()
        assert self.outputs_queue is not None
        item = await self.outputs_queue.get()
        if isinstance(item, Exception):
            self.outputs_queue.put_nowait(item)
            raise item
        return item

    async def call_async(self, call: Call[R]) -> R:
        future = asyncio.get_running_loop().create_future()
        await self._send(EngineCoreRequestType.UTILITY, self._utility_call(call, future))
        return await future

    async def call_each_async(self, call: Call[R]) -> list[R | None]:
        return [await self.call_async(call)]

    def shutdown(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
        self.transport.stop_async()
        super().shutdown()

