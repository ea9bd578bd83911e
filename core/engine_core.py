"""EngineCore: the schedule -> execute -> update loop, and its process wrapper.

``EngineCore`` is transport-free (the in-process client drives it directly).
``EngineCoreProc`` adds what vLLM V1's engine process has: an input thread
that reads and decodes requests into ``input_queue`` (building each
``Request`` there, prompt block hashes included, off the busy loop; aborts
also go into ``aborts_queue`` so a step can drop them before updating), an
output thread that encodes ``output_queue`` onto the wire, the busy loop,
utility calls by ``call_id``, and the RUNNING -> REQUESTED -> SHUTTING_DOWN
state machine.

``step_fn`` is ``step`` (schedule, execute, update) or, with async
scheduling, ``step_with_batch_queue``, which schedules and dispatches batch
N+1 before it waits for batch N.

Whoever drives the engine calls ``run_once`` in a loop: a step when there is
work, otherwise the completion of the control calls that wait for the engine
to be idle (pause, sleep: their ``Future`` is completed then, and the process
replies to the client only then); it returns everything ready for the
clients, outputs made outside a step (requests a pause aborted) included.
The in-process clients and the process's busy loop are such drivers.
Utilities (core/utilities.py) arrive with typed arguments (``call_utility``).
"""

from __future__ import annotations

import enum
import logging
import os
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import msgspec

from core.affinity import pin_engine_threads
from core.config import EngineConfig
from core.heap import freeze_startup_heap
from core.load import EngineLoadWriter
from core.protocol import (
    ENGINE_CORE_DEAD,
    PAUSE_MODES,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineStats,
    FinishReason,
    HandshakeReady,
    LoRARequest,
    MemoryUsage,
    SchedulerStats,
    SleepResult,
    UtilityOutput,
    finished_outputs,
)
from core.request import Request, RequestStatus
from core.sched.output import ModelRunnerOutput, SchedulerOutput
from core.sched.scheduler import Scheduler
from core.structured.manager import StructuredOutputManager
from core.thread_pools import use_one_blas_thread
from core.transport import ChannelClosed, EngineInbox, EngineTransport, PeerDeadError
from core.utilities import UTILITIES, Utility, UtilityArgs, UtilityCall
from core.validation import ModelLimits, validate_request
from core.worker.executor import UniProcExecutor
from kernels.kv_format import storage_name
from shm.serial import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger("ringllm.engine")

T = TypeVar("T")
Outputs = list[tuple[int, EngineCoreOutputs]]  # (client index, outputs), in the order made


class EngineCore:
    """Owns the scheduler and executor; ``step()`` is one engine iteration."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.limits = ModelLimits.from_config(self.config)
        self.model_executor = UniProcExecutor(self.config)
        self.num_gpu_blocks = self.model_executor.determine_num_blocks()
        self.model_executor.initialize_kv_cache(self.num_gpu_blocks)
        self.structured_output_manager = StructuredOutputManager(self.config)
        self.scheduler = Scheduler(self.config, self.num_gpu_blocks, self.structured_output_manager)
        # Requests built off the busy loop (input thread) are hashed with it.
        self.request_block_hasher = self.scheduler.block_hasher
        self.aborts_queue: queue.Queue[list[str]] = queue.Queue()
        self.step_counter = 0
        # Batches dispatched and not yet fed back, newest on the left.
        self.batch_queue_size = self.model_executor.max_concurrent_batches
        self.batch_queue: deque[tuple[Future[ModelRunnerOutput], SchedulerOutput]] | None = None
        if self.batch_queue_size > 1:
            self.batch_queue = deque(maxlen=self.batch_queue_size)
        self.step_fn = self.step if self.batch_queue is None else self.step_with_batch_queue
        self.use_spec_decode = config.speculative_config is not None
        # Control calls waiting for the engine to be idle, and outputs made
        # outside a step, which run_once hands to an in-process driver (emit_output).
        self._idle_waiters: list[tuple[Future, Callable[[], Any]]] = []
        self._side_outputs: Outputs = []
        # The adapters served from the start (the runner's LoRAAdapters is the one registry).
        for lora_request in config.lora_config.lora_requests() if config.lora_config else ():  # --lora-modules
            self.add_lora(lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path)
        logger.info(
            "EngineCore %d (pid %d) ready: %d KV blocks of %d tokens, max_model_len %d",
            self.config.parallel_config.data_parallel_rank, os.getpid(), self.num_gpu_blocks,
            self.config.cache_config.block_size,
            self.config.max_model_len,
        )

    # ---------------------------------------------------------------- requests

    def preprocess_add_request(self, request: EngineCoreRequest) -> Request:
        """Validate and build the scheduler's Request; ValueError when it is unacceptable.

        The frontend has validated it with the same rules, but the engine never
        trusts the wire. The process's input thread runs this, so the copying
        and hashing it does (prompt embeddings, prefix-cache block hashes)
        overlap the model instead of stalling the loop.
        """
        validate_request(request, self.limits)
        built = Request.from_engine_core_request(request, self.request_block_hasher)
        structured = request.sampling_params.structured_outputs
        if structured is not None:  # its grammar starts compiling on the pool now
            built.structured = self.structured_output_manager.new_request(structured)
        reasoning = request.sampling_params.reasoning
        if reasoning is not None and (structured is not None or reasoning.budget is not None):
            built.reasoning = reasoning  # else the reasoning changes nothing the engine does
        return built

    def add_request(self, request: Request) -> None:
        """Queue ``request``; ValueError when it names a LoRA adapter that cannot be loaded."""
        if request.lora_request is not None:
            self._ensure_lora(request.lora_request)
        self.scheduler.add_request(request)

    def _ensure_lora(self, lora_request: LoRARequest) -> None:
        """Load the request's adapter unless the runner holds it (a first use, or one evicted)."""
        if self.config.lora_config is None:
            raise ValueError("this server serves no LoRA adapters (start it with --enable-lora)")
        if not self.model_executor.has_lora(lora_request.lora_int_id):
            self.add_lora(lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def _process_aborts_queue(self) -> None:
        while not self.aborts_queue.empty():
            try:
                self.abort_requests(self.aborts_queue.get_nowait())
            except queue.Empty:
                break

    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """Schedule, execute, update; returns per-client outputs and whether the model ran."""
        if not self.scheduler.has_requests():
            return {}, False
        scheduler_output = self.scheduler.schedule()
        future = self.model_executor.execute_model(scheduler_output, non_block=True)
        model_output = future.result()
        # Aborts that arrived during the forward pass: drop them before their
        # sampled tokens would be appended and reported.
        self._process_aborts_queue()
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self.step_counter += 1
        model_executed = scheduler_output.total_num_scheduled_tokens > 0
        self.post_step(model_executed)
        return outputs, model_executed

    def post_step(self, model_executed: bool) -> None:
        """Speculative decoding: hand the drafts proposed after this step to the
        scheduler, which schedules them with the next one (async scheduling, which
        schedules before this step's tokens are known, is refused with it)."""
        if self.use_spec_decode and model_executed:
            draft_token_ids = self.model_executor.take_draft_token_ids()
            if draft_token_ids is not None:
                self.scheduler.update_draft_token_ids(draft_token_ids)

    def step_with_batch_queue(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """Schedule and dispatch a new batch, then feed back the oldest one.

        With a queue of two this keeps the worker busy: batch N+1 is
        scheduled while batch N runs, and N's tokens are appended afterwards.
        N+1 may hold a decode for a request whose N token is not known yet:
        the scheduler counts that token as a placeholder (so the decode's
        position and blocks are right), and the runner, which executes
        batches in order and appended the token to its own batch state when
        N finished, reads it from there. Batches are not the same as in
        sync mode (what N frees or finishes is seen one schedule later), but
        a request's tokens depend only on its own tokens and KV cache, and
        these stay exact:

        - a request whose in-flight token might end it is scheduled once
          more; a stop found in N's update finishes it, and
          update_from_output ignores finished requests, so N+1's extra token
          is dropped (its slot lies past the request's known tokens, in a
          block that is never registered in the prefix cache). A stop it can
          foresee (max_tokens, max_model_len) is not scheduled at all;
        - a request preempted or aborted while its batch is in flight has
          that batch's token dropped: update_from_output skips requests that
          are not running, and ones preempted after the batch was scheduled
          (``step_id`` against ``Request.preempted_at_step``), which also
          covers a request preempted and already resumed;
        - blocks freed while a batch that writes them is in flight can go to
          another request only in a later batch, which runs after it.

        Returns no outputs while the oldest batch is still running and the
        queue has room.
        """
        batch_queue = self.batch_queue
        assert batch_queue is not None
        model_executed = False
        if self.scheduler.has_requests():
            scheduler_output = self.scheduler.schedule()
            future = self.model_executor.execute_model(scheduler_output, non_block=True)
            batch_queue.appendleft((future, scheduler_output))
            model_executed = scheduler_output.total_num_scheduled_tokens > 0
            if model_executed and len(batch_queue) < self.batch_queue_size and not batch_queue[-1][0].done():
                return {}, True
        elif not batch_queue:
            return {}, False
        future, scheduler_output = batch_queue.pop()
        model_output = future.result()
        self._process_aborts_queue()
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self.step_counter += 1
        return outputs, model_executed

    def has_batches_in_flight(self) -> bool:
        return bool(self.batch_queue)

    def has_work(self) -> bool:
        """A step is due: requests to schedule, or batches whose outputs are owed."""
        return self.scheduler.has_requests() or self.has_batches_in_flight()

    def has_compiling_grammars(self) -> bool:
        """Requests wait for nothing but their grammars (the waker is called when one is ready)."""
        return bool(self.scheduler.waiting_for_fsm)

    def set_waker(self, wake: Callable[[], None]) -> None:
        """``wake()`` is called, from another thread, when work appears that no request
        brought (a grammar compiled): a driver that sleeps for lack of work wakes up."""
        self.structured_output_manager.on_ready = wake

    def run_once(self) -> Outputs:
        """One turn of a driver: a step if there is work, else the completion of the
        control calls waiting for the engine to be idle. Returns what is ready for the
        clients: outputs made outside a step first (they were made before it)."""
        ready, self._side_outputs = self._side_outputs, []
        if self.has_work():
            outputs, _ = self.step_fn()
            ready.extend(outputs.items())
        else:
            self.notify_idle()
        if self._side_outputs:  # made by a control call completed just now
            ready.extend(self._side_outputs)
            self._side_outputs = []
        return ready

    def is_idle(self) -> bool:
        """Nothing to run and nothing owed: a driver may sleep until a request or a waker."""
        return not self.has_work() and not self._idle_waiters and not self._side_outputs

    # ---------------------------------------------------------------- control

    def emit_output(self, client_index: int, outputs: EngineCoreOutputs) -> None:
        """Deliver outputs made outside a step (``run_once`` returns them)."""
        self._side_outputs.append((client_index, outputs))

    def when_idle(self, fn: Callable[[], T]) -> Future[T]:
        """A Future of ``fn()``, run the next time the engine has no work (``notify_idle``)."""
        future: Future[T] = Future()
        self._idle_waiters.append((future, fn))
        return future

    def notify_idle(self) -> bool:
        """Called by the engine's driver when ``has_work()`` is False: completes the
        control calls that waited for it. True if there were any (they may have
        left work, such as preemptions to tell the runner about)."""
        if not self._idle_waiters:
            return False
        waiters, self._idle_waiters = self._idle_waiters, []
        for future, fn in waiters:
            try:
                future.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - the caller gets it as the utility's failure
                future.set_exception(exc)
        return True

    def _report_aborted(self, requests: list[Request]) -> None:
        by_client: dict[int, list[str]] = {}
        for request in requests:
            by_client.setdefault(request.client_index, []).append(request.request_id)
        for client_index, ids in by_client.items():
            self.emit_output(client_index, finished_outputs(ids, FinishReason.ABORT))

    def _check_pause_mode(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; use one of {', '.join(PAUSE_MODES)}")

    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> Future[bool]:
        """Stop starting requests (``core.protocol.PAUSE_MODES``). Completes once the
        engine is idle: the aborted requests reported ("abort"), the ones in flight
        finished ("wait"), no batch in flight; then, with ``clear_cache`` (not with
        "keep", whose requests hold their blocks), the prefix cache is emptied."""
        self._check_pause_mode(mode)
        self._report_aborted(self.scheduler.pause(mode))

        def paused() -> bool:
            if clear_cache and mode != "keep":
                self.scheduler.reset_prefix_cache()
            return True

        return self.when_idle(paused)

    def resume_scheduler(self) -> bool:
        if self.model_executor.sleep_level:
            raise ValueError("the engine is asleep; wake it up (POST /wake_up), which also resumes it")
        self.scheduler.resume()
        return True

    def is_scheduler_paused(self) -> bool:
        return self.scheduler.paused

    def sleep(self, level: int = 1, mode: str = "abort") -> Future[SleepResult]:
        """Pause (``mode``), then once idle free the KV cache and, by ``level``, the
        weights (core/worker/sleep.py). Requests kept by "keep" lose their KV cache
        and are recomputed after ``wake_up``."""
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is off; start the server with --enable-sleep-mode")
        self.model_executor.check_sleep(level)
        self._check_pause_mode(mode)
        self._report_aborted(self.scheduler.pause(mode))

        def go_to_sleep() -> SleepResult:
            # The KV cache is about to vanish: no block may be held or cached.
            if not self.scheduler.reset_prefix_cache(reset_running_requests=True):
                raise RuntimeError("KV cache blocks are still in use; not going to sleep")
            before = self.model_executor.memory_usage()
            self.model_executor.sleep(level)
            return SleepResult(level=level, before=before, after=self.model_executor.memory_usage())

        return self.when_idle(go_to_sleep)

    def wake_up(self) -> MemoryUsage:
        """Weights and KV cache back, then resume; does nothing unless asleep."""
        if self.model_executor.sleep_level:
            self.model_executor.wake_up(self.num_gpu_blocks)
            self.scheduler.resume()
        return self.model_executor.memory_usage()

    def is_sleeping(self) -> bool:
        return bool(self.model_executor.sleep_level)

    def collective_rpc(
        self, method: str, args: list[Any] | None = None, kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return self.model_executor.collective_rpc(method, args, kwargs)

    # ---------------------------------------------------------------- utilities

    def get_scheduler_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        stats.step_counter = self.step_counter
        return stats

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix; refused (False) while requests run,
        unless ``reset_running_requests`` preempts them first."""
        return self.scheduler.reset_prefix_cache(reset_running_requests)

    def add_lora(self, lora_name: str, lora_int_id: int, lora_path: str) -> bool:
        """Load an adapter (ValueError naming what is wrong with it); False if it was loaded."""
        if self.config.lora_config is None:
            raise ValueError("LoRA adapters are off: start the server with --enable-lora")
        return self.model_executor.add_lora(LoRARequest(lora_name, lora_int_id, lora_path), self._loras_in_use())

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; refused (ValueError) while a request runs or waits with it, so
        that no request loses its adapter halfway. False: no such adapter was loaded."""
        users = sum(1 for r in self.scheduler.requests.values() if r.lora_int_id == lora_id)
        if users:
            name = self.model_executor.lora_name(lora_id) or lora_id
            raise ValueError(
                f"LoRA adapter {name!r} is in use by {users} unfinished request(s): unload it once they finish"
            )
        return self.model_executor.remove_lora(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        """Keep an added adapter loaded (loading it again if it was evicted); False if unknown."""
        if self.config.lora_config is None:
            return False
        return self.model_executor.pin_lora(lora_id, self._loras_in_use())

    def list_loras(self) -> list[int]:
        """The numbers of the adapters loaded now."""
        return self.model_executor.list_loras() if self.config.lora_config is not None else []

    def _loras_in_use(self) -> set[int]:
        return {r.lora_int_id for r in self.scheduler.requests.values() if r.lora_int_id}

    def call_utility(self, utility: Utility[Any], args: UtilityArgs) -> Any:
        """Run one of the methods a client may call (core/utilities.py) with its typed
        arguments; a Future when the result waits for the engine to be idle."""
        return getattr(self, utility.name)(**msgspec.structs.asdict(args))

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.model_executor.shutdown()


class EngineShutdownState(enum.Enum):
    RUNNING = 0
    REQUESTED = 1
    SHUTTING_DOWN = 2


class _PeerGone:
    """Queued by an I/O thread when the frontend is gone: stop without draining."""


# The signals that stop an engine. The kernel hands a process's signal to any of its threads
# that does not block it, and CPython runs the Python handler only in the main thread, once that
# thread runs Python again: a main thread parked on an empty queue would never see a signal that
# another thread took. So the I/O threads block them, and the idle wait wakes now and then for
# the threads that are not ours (OpenMP's, a library's), within SIGNAL_CHECK_S.
SHUTDOWN_SIGNALS = {signal.SIGTERM, signal.SIGINT}
SIGNAL_CHECK_S = 1.0


def _leave_signals_to_the_main_thread() -> None:
    """Called first in each thread the engine starts."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SHUTDOWN_SIGNALS)


class EngineCoreProc(EngineCore):
    """EngineCore in its own process, talking to its clients over one link each.

    ``links[i]`` is the transport to the frontend with client index ``i``
    (one per API server process). With data parallelism the engine also
    publishes its load (``core.load``) after every step, for the frontends'
    routing.
    """

    def __init__(
        self, config: EngineConfig, links: list[EngineTransport], load_writer: EngineLoadWriter | None = None
    ) -> None:
        self.links = links
        self.transport = links[0]
        self.inbox = EngineInbox(links)
        self.engine_index = config.parallel_config.data_parallel_rank
        self.load_writer = load_writer
        # ADDs taken from each client (the load table reports them, so that a
        # client can tell which of its requests the figures already count).
        self.num_received = [0] * len(links)
        self.num_rejected = [0] * len(links)  # input thread's count, apart to avoid a shared +=
        self.input_queue: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self.shutdown_state = EngineShutdownState.RUNNING
        self._drain_deadline = 0.0
        # Busy-loop accounting for EngineStats: time blocked waiting for work.
        self.idle_seconds = 0.0
        self._loop_started = time.monotonic()
        super().__init__(config)
        # A grammar compiled: wake the busy loop if it sleeps on the input queue.
        self.set_waker(lambda: self.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None)))
        # READY goes out before the I/O threads start, so the output thread is
        # the only user of the sending side from then on.
        ready = HandshakeReady(
            status="READY",
            num_gpu_blocks=self.num_gpu_blocks,
            kv_cache_groups=self.model_executor.runner.kv_groups.num_groups,
            max_model_len=self.config.max_model_len,
            block_size=self.config.cache_config.block_size,
            dtype=str(self.model_executor.runner.dtype).removeprefix("torch."),
            kv_cache_dtype=(
                "none" if self.model_executor.runner.encoder
                else storage_name(self.model_executor.runner.kv_dtype)
            ),
            device=str(self.model_executor.runner.device),
            kv_cache_bytes=0 if self.model_executor.runner.encoder
            else self.num_gpu_blocks * self.model_executor.runner.kv_bytes_per_block(),
        )
        self.publish_load()  # before READY: a router never reads a previous engine's row
        for link in links:
            link.send([b"READY", msgspec.msgpack.encode(ready)])
        cpu = pin_engine_threads(config.engine_cpu, self.engine_index)  # the I/O threads started below inherit it
        if cpu is not None:
            logger.info("EngineCore threads on core %d", cpu)
        if self.model_executor.runner.products_are_small():
            use_one_blas_thread()
            logger.info("BLAS on one thread: the model's weights are all small")
        self._input_thread = threading.Thread(target=self._process_input_socket, name="EngineCoreInput", daemon=True)
        self._output_thread = threading.Thread(target=self._process_output_socket, name="EngineCoreOutput", daemon=True)
        self._input_thread.start()
        self._output_thread.start()

    # ------------------------------------------------------------- I/O threads

    def _process_input_socket(self) -> None:
        """Input thread: read, decode and preprocess, off the busy loop's thread."""
        _leave_signals_to_the_main_thread()
        # Typed decoders: no pickle, and a malformed frame raises instead of
        # reaching the scheduler. Only ADD may carry tensors (aux frames or pool,
        # the pool being the link's own).
        decoders = [
            {
                EngineCoreRequestType.ADD: MsgpackDecoder(
                    EngineCoreRequest, pool=link.pool_reader, cuda_ipc=link.cuda_importer
                ),
                EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
                EngineCoreRequestType.UTILITY: MsgpackDecoder(UtilityCall),
            }
            for link in self.links
        ]
        while True:
            try:
                client_index, frames = self.inbox.recv()
            except ChannelClosed:
                return  # our own shutdown
            except PeerDeadError:
                self.input_queue.put_nowait((_PeerGone, None))
                return
            try:
                item = self._decode_request(frames, decoders[client_index])
            except Exception as exc:  # noqa: BLE001 - whatever the bytes were, this thread must live on
                logger.error("rejected a malformed message from the frontend: %s: %s", type(exc).__name__, exc)
                continue
            req_type, payload = item
            if req_type == EngineCoreRequestType.ADD:
                payload.client_index = client_index  # the link it came by, whatever the body says
                try:
                    item = (req_type, self.preprocess_add_request(payload))
                except ValueError as exc:
                    self._reject_request(payload, str(exc))
                    continue
                except Exception as exc:  # noqa: BLE001 - a request no check foresaw: refuse it, keep serving
                    logger.error("rejected a request the engine could not build", exc_info=exc)
                    self._reject_request(payload, f"{type(exc).__name__}: {exc}")
                    continue
            elif req_type == EngineCoreRequestType.UTILITY:
                payload.client_index = client_index  # the link it came by
            elif req_type == EngineCoreRequestType.ABORT:
                self.aborts_queue.put_nowait(payload)
            self.input_queue.put_nowait(item)

    def _reject_request(self, request: EngineCoreRequest, reason: str) -> None:
        """A request that cannot run finishes with an error straight away: the
        output goes to the output thread, the busy loop never sees it."""
        logger.warning("rejected request %s: %s", request.request_id, reason)
        self.num_rejected[request.client_index] += 1
        outputs = finished_outputs([request.request_id], FinishReason.ERROR, reason)
        self.output_queue.put_nowait((request.client_index, outputs))

    @staticmethod
    def _decode_request(
        frames: list, decoders: dict[EngineCoreRequestType, MsgpackDecoder]
    ) -> tuple[EngineCoreRequestType, Any]:
        if not frames:
            raise ValueError("empty message")
        req_type = EngineCoreRequestType(bytes(frames[0]))
        if req_type == EngineCoreRequestType.WAKEUP:
            return req_type, None
        decoder = decoders.get(req_type)
        if decoder is None:
            raise ValueError(f"unsupported request type {req_type.name}")
        if len(frames) < 2 or (len(frames) > 2 and req_type != EngineCoreRequestType.ADD):
            raise ValueError(f"{req_type.name} message has {len(frames)} frames")
        return req_type, decoder.decode(frames[1:])

    def _process_output_socket(self) -> None:
        """Output thread: encode into one reused buffer; the client's ring copies it out."""
        _leave_signals_to_the_main_thread()
        encoders = [MsgpackEncoder(pool=link.pool_writer, cuda_ipc=link.cuda_exporter) for link in self.links]
        buf = bytearray(64 * 1024)
        engine_index = self.engine_index
        while True:
            item = self.output_queue.get()
            try:
                if isinstance(item, tuple) and item[0] is ENGINE_CORE_DEAD:
                    for link in self.links:
                        link.send([ENGINE_CORE_DEAD, item[1].encode()])
                    return
                if item is None:  # clean shutdown
                    return
                client_index, outputs = item
                outputs.engine_index = engine_index
                self.links[client_index].send(encoders[client_index].encode_into(outputs, buf))
            except PeerDeadError:
                self.input_queue.put_nowait((_PeerGone, None))
                return

    # --------------------------------------------------------------- busy loop

    def run_busy_loop(self) -> None:
        freeze_startup_heap()
        self._loop_started = time.monotonic()
        while self._handle_shutdown():
            self._process_input_queue()
            self._process_engine_step()

    def is_running(self) -> bool:
        return self.shutdown_state == EngineShutdownState.RUNNING

    def _process_input_queue(self) -> None:
        """Block while idle; then drain everything queued so ADDs batch together."""
        while self.is_idle() and self.is_running():
            if self.input_queue.empty():
                with self.aborts_queue.mutex:
                    self.aborts_queue.queue.clear()
            self.publish_load()
            waited_from = time.monotonic()
            item = self._next_input()
            self.idle_seconds += time.monotonic() - waited_from
            self._handle_client_request(*item)
        while not self.input_queue.empty():
            self._handle_client_request(*self.input_queue.get_nowait())

    def _next_input(self) -> tuple[Any, Any]:
        """The next queued input, waited for in spans of SIGNAL_CHECK_S: between two, a
        signal another thread took runs its handler here, which queues a wake-up."""
        while True:
            try:
                return self.input_queue.get(timeout=SIGNAL_CHECK_S)
            except queue.Empty:
                continue

    def publish_load(self) -> None:
        """This engine's row of the load table: what the routers read."""
        if self.load_writer is not None:
            received = [a + r for a, r in zip(self.num_received, self.num_rejected)]
            self.load_writer.publish(self.scheduler, received)

    def _process_engine_step(self) -> None:
        ready = self.run_once()
        self.publish_load()
        for client_index, outputs in ready:
            if client_index == 0 and outputs.scheduler_stats is not None:
                outputs.engine_stats = self._engine_stats()
            self.output_queue.put_nowait((client_index, outputs))

    def _engine_stats(self) -> EngineStats:
        now = time.monotonic()
        return EngineStats(
            transport=self.transport.stats(),
            idle_seconds=self.idle_seconds,
            loop_seconds=now - self._loop_started,
            idle=not self.has_work() and self.input_queue.empty(),
            timestamp=now,
        )

    def emit_output(self, client_index: int, outputs: EngineCoreOutputs) -> None:
        self.output_queue.put_nowait((client_index, outputs))

    def _handle_client_request(self, req_type: Any, payload: Any) -> None:
        if req_type is _PeerGone:
            logger.warning("frontend is gone; EngineCore stops without draining")
            self.shutdown_state = EngineShutdownState.SHUTTING_DOWN
            self._drain_deadline = 0.0
        elif req_type == EngineCoreRequestType.ADD:
            self._handle_add(payload)
        elif req_type == EngineCoreRequestType.ABORT:
            self.abort_requests(payload)
        elif req_type == EngineCoreRequestType.UTILITY:
            client_index, call_id, method = payload.client_index, payload.call_id, payload.method
            try:
                utility = UTILITIES.get(method)
                if utility is None:
                    raise ValueError(f"unknown utility method {method!r}")
                result = self.call_utility(utility, utility.decode_args(payload.args))
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                self._reply_utility(client_index, call_id, method, exc=exc)
                return
            if isinstance(result, Future):  # replied once the engine is idle
                result.add_done_callback(
                    lambda done: self._reply_utility(client_index, call_id, method, done=done)
                )
            else:
                self._reply_utility(client_index, call_id, method, result)
        # WAKEUP only unblocks input_queue.get(); nothing else to do.

    def _reply_utility(
        self,
        client_index: int,
        call_id: int,
        method: str,
        result: Any = None,
        exc: BaseException | None = None,
        done: Future | None = None,
    ) -> None:
        out = UtilityOutput(call_id)
        try:
            if done is not None:
                result = done.result()
            if exc is None:
                out.result = msgspec.Raw(msgspec.msgpack.encode(result))
        except Exception as error:  # noqa: BLE001 - reported to the caller
            exc = error
        if exc is not None:
            out.failure_message = f"utility {method!r} failed: {exc}"
        self.output_queue.put_nowait((client_index, EngineCoreOutputs(utility_output=out)))

    def _handle_add(self, request: Request) -> None:
        if not self.is_running():
            refused = finished_outputs([request.request_id], FinishReason.ABORT, "the engine is shutting down")
            self.output_queue.put_nowait((request.client_index, refused))
        elif request.request_id in self.scheduler.requests:
            # The frontend never reuses a live id: such a message is malformed. Answering
            # it would finish the live request, so it is dropped.
            logger.error("rejected a malformed message from the frontend: request id %r is already running",
                         request.request_id)
        else:
            try:
                self.add_request(request)
            except (ValueError, OSError) as exc:  # its LoRA adapter cannot be loaded
                logger.warning("rejected request %s: %s", request.request_id, exc)
                refused = finished_outputs([request.request_id], FinishReason.ERROR, str(exc))
                self.output_queue.put_nowait((request.client_index, refused))
        self.num_received[request.client_index] += 1

    def _handle_shutdown(self) -> bool:
        """True while the loop should go on; drains for a bounded time after a signal."""
        if self.shutdown_state == EngineShutdownState.RUNNING:
            return True
        if self.shutdown_state == EngineShutdownState.REQUESTED:
            self.shutdown_state = EngineShutdownState.SHUTTING_DOWN
            self._drain_deadline = time.monotonic() + self.config.engine_drain_timeout
            logger.info(
                "shutdown requested: draining %d requests for up to %.1fs",
                self.scheduler.get_num_unfinished_requests(), self.config.engine_drain_timeout,
            )
        if not self.scheduler.has_unfinished_requests():
            return False
        if time.monotonic() < self._drain_deadline and self.has_work():
            return True
        # Out of time, or nothing left can progress (held or kept by a pause).
        self._abort_all_and_report()
        return False

    def _abort_all_and_report(self) -> None:
        ids = self.scheduler.unfinished_request_ids()
        requests = [self.scheduler.requests[i] for i in ids if i in self.scheduler.requests]
        self.abort_requests(ids)
        self._report_aborted(requests)

    def request_shutdown(self) -> None:
        """Signal-safe: flip the state and wake the main thread if it is parked."""
        if self.shutdown_state == EngineShutdownState.RUNNING:
            self.shutdown_state = EngineShutdownState.REQUESTED
        self.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))

    def send_engine_dead(self, message: str) -> None:
        self.output_queue.put_nowait((ENGINE_CORE_DEAD, message))
        self._output_thread.join(timeout=5)

    def shutdown(self) -> None:
        """Stop both I/O threads (flushing queued outputs first), then the executor."""
        self.output_queue.put_nowait(None)
        self._output_thread.join(timeout=5)
        self.stop_input_thread()
        super().shutdown()

    def stop_input_thread(self) -> None:
        """Wake the input thread out of its blocking recv and wait for it, so that
        the transport can be closed under no one's feet."""
        self.inbox.interrupt()
        self._input_thread.join(timeout=5)


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the frontend dies, even by kill -9 (no orphans)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def run_engine_core(
    config: EngineConfig, transport_specs: Any, parent_pid: int, load_table: str | None = None
) -> None:
    """Entry point of the spawned EngineCore process; exits the process when done.

    ``transport_specs``: one TransportSpec (a single frontend) or a list of them,
    client index = position."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [engine] %(message)s")
    specs = transport_specs if isinstance(transport_specs, (list, tuple)) else [transport_specs]
    code = serve_engine(config, list(specs), load_table, parent_pid=parent_pid)
    # Outputs are flushed and the transport closed: skip the interpreter's teardown,
    # which with torch loaded adds half a second or more to every shutdown.
    logging.shutdown()
    os._exit(code)


def serve_engine(
    config: EngineConfig,
    specs: list[Any],
    load_table: str | None,
    *,
    parent_pid: int | None,
    frontend_is_parent: bool = True,
) -> int:
    """Handshake, busy loop, shutdown; the exit code. ``parent_pid``: the frontend,
    which spawned this process (``frontend_is_parent``), or runs beside it on this host
    (an engine placed by Ray), or None: on another host (Ray, or a headless engine)."""
    if frontend_is_parent:
        assert parent_pid is not None
        _die_with_parent()
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            for spec in specs:
                EngineTransport.drop_orphaned(spec)
            return 1
    engine: EngineCoreProc | None = None
    # Until the engine exists a signal just exits; afterwards it starts a drain.
    try:
        for sig in SHUTDOWN_SIGNALS:
            signal.signal(sig, lambda *_: (engine.request_shutdown() if engine else os._exit(0)))
    except ValueError:  # not the main thread (an actor's executor): its owner stops it
        pass
    links: list[EngineTransport] = []
    load_writer: EngineLoadWriter | None = None
    try:
        for spec in specs:
            links.append(EngineTransport.attach(spec, parent_pid, child=frontend_is_parent))
        for link in links:
            link.send([b"HELLO"])
        if load_table is not None:
            load_writer = EngineLoadWriter.attach(load_table)
        try:
            engine = EngineCoreProc(config, links, load_writer)
        except Exception as exc:
            if isinstance(exc, ValueError):  # a config it cannot serve: the message says why
                logger.error("EngineCore failed to start: %s", exc)
                logger.debug("where it was refused", exc_info=True)
            else:
                logger.exception("EngineCore failed to start")
            for link in links:
                link.send([ENGINE_CORE_DEAD, f"EngineCore failed to start: {exc}".encode()])
            return 1
        try:
            engine.run_busy_loop()
        except Exception as exc:
            logger.exception("EngineCore hit a fatal error")
            engine.send_engine_dead(f"EngineCore hit a fatal error: {exc!r}")
            engine.stop_input_thread()
            return 1
        engine.shutdown()
        return 0
    except PeerDeadError:
        logger.warning("frontend went away; EngineCore exits")
        return 1
    finally:
        for link in links:
            link.close()
        if load_writer is not None:
            load_writer.close()
