"""Executor: the EngineCore's handle on the workers (one in-process worker here).

``execute_model(..., non_block=True)`` returns a Future so that EngineCore.step
keeps the seeds' shape (dispatch, overlap CPU work, join). With one in-process
worker the forward pass runs inline and the Future is already resolved.
"""

from __future__ import annotations

from concurrent.futures import Future

from core.config import EngineConfig
from core.sched.output import ModelRunnerOutput, SchedulerOutput
from core.worker.model_runner import ModelRunner


class UniProcExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)
        self.runner.load_model()

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if not non_block:
            return self.runner.execute_model(scheduler_output)
        future: Future[ModelRunnerOutput] = Future()
        try:
            future.set_result(self.runner.execute_model(scheduler_output))
        except BaseException as exc:  # surfaced by future.result() in step()
            future.set_exception(exc)
        return future

    def shutdown(self) -> None:
        self.runner.kv_caches = []
        self.runner.model = None
