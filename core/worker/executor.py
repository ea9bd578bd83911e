"""Executor: the EngineCore's handle on the workers (one in-process worker here).

``execute_model(..., non_block=True)`` returns a Future so that EngineCore
keeps vLLM V1's shape (dispatch, overlap CPU work, join).

Synchronous scheduling runs the forward pass inline on the engine thread and
hands back a resolved Future: a thread hop would only add latency when
nothing overlaps. With async scheduling the model runner lives on one
dedicated worker thread instead, and the Future resolves when that thread
finishes the batch; meanwhile the engine thread schedules the next one
(torch releases the GIL inside its kernels). Ownership is strict either way:
the runner and its persistent ``InputBatch`` are touched only by the thread
that executes batches (after start-up, the worker thread when there is one),
and batches run one at a time in submission order, which is what lets the
scheduler hand out a batch that depends on the one still running.

On a GPU the runner returns as soon as a step's work is enqueued, with its
sampled ids still being copied to the host (``AsyncModelRunnerOutput``). The
Future's ``result()`` materialises them on the thread that asks (the engine
thread, before ``update_from_output``), so the worker thread goes straight
on to the next batch.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from core.config import EngineConfig
from core.sched.output import ModelRunnerOutput, SchedulerOutput
from core.worker.async_output import AsyncModelRunnerOutput
from core.worker.model_runner import ModelRunner


def _materialise(output: ModelRunnerOutput | AsyncModelRunnerOutput) -> ModelRunnerOutput:
    return output.get_output() if isinstance(output, AsyncModelRunnerOutput) else output


class OutputFuture(Future):
    """The worker thread's Future, whose ``result()`` also waits for the sampled ids.

    It is done when the worker is done with the batch (the GPU may still be
    running it); ``result()`` then blocks, on the caller's thread, until the
    ids have reached the host.
    """

    def __init__(self, inner: Future) -> None:
        super().__init__()
        inner.add_done_callback(self._resolve)

    def _resolve(self, inner: Future) -> None:
        if inner.cancelled():
            self.cancel()
            return
        exc = inner.exception()
        if exc is not None:
            self.set_exception(exc)
        else:
            self.set_result(inner.result())

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        return _materialise(super().result(timeout))


class UniProcExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)
        self.runner.load_model()
        # Batches the engine may have in flight: the one running plus the one
        # being scheduled. A deeper queue would not add overlap with a single
        # worker thread, only latency.
        self.max_concurrent_batches = 2 if config.async_scheduling else 1
        self._worker: ThreadPoolExecutor | None = None
        if config.async_scheduling:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ModelRunner")

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if self._worker is not None:
            future = OutputFuture(self._worker.submit(self.runner.execute_model, scheduler_output))
            return future if non_block else future.result()
        if not non_block:
            return _materialise(self.runner.execute_model(scheduler_output))
        future = Future()
        try:
            future.set_result(_materialise(self.runner.execute_model(scheduler_output)))
        except BaseException as exc:  # surfaced by future.result() in step()
            future.set_exception(exc)
        return future

    def shutdown(self) -> None:
        if self._worker is not None:
            # A batch still in flight finishes before the tensors go away.
            self._worker.shutdown(wait=True)
            self._worker = None
        self.runner.decode_graphs = None  # graphs hold the caches' addresses and their own pool
        self.runner.kv_caches = []
        self.runner.model = None
