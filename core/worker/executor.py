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

Sleep mode and ``collective_rpc`` run on the thread that owns the runner
too, between batches (the engine puts itself to sleep only once idle).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec

from core.config import EngineConfig
from core.models.loader import load_model
from core.protocol import LoRARequest, MemoryUsage
from core.sched.output import DraftTokenIds, ModelRunnerOutput, SchedulerOutput
from core.worker.async_output import AsyncModelRunnerOutput
from core.worker.faults import fault_injector_from_env
from core.worker.model_runner import ModelRunner
from core.worker.sleep import (
    WeightStash,
    block_weights,
    device_bytes,
    drop_weights,
    release_freed_memory,
    resident_bytes,
    tensor_bytes,
    weight_bytes,
)

T = TypeVar("T")


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
        self.max_concurrent_batches = 2 if config.scheduler_config.async_scheduling else 1
        self._worker: ThreadPoolExecutor | None = None
        if config.scheduler_config.async_scheduling:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ModelRunner")
        self._sleep_level = 0
        self._stash: WeightStash | None = None
        self._faults = fault_injector_from_env()  # tests only (core/worker/faults.py)

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if self._faults is not None:
            self._faults.before_step()
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

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts the runner proposed after the last step (speculative decoding)."""
        return self._on_runner_thread(self.runner.take_draft_token_ids)

    # ---------------------------------------------------------- runner calls

    def _on_runner_thread(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the thread that owns the runner (the worker, if any)."""
        if self._worker is None:
            return fn()
        return self._worker.submit(fn).result()

    @property
    def sleep_level(self) -> int:
        return self._sleep_level

    def check_sleep(self, level: int) -> None:
        """Raise ValueError unless the engine can go to sleep at ``level`` now."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self._sleep_level:
            raise ValueError(f"the engine is already asleep (level {self._sleep_level})")
        if level == 1 and self.runner.model is not None and block_weights(self.runner.model):
            raise ValueError(
                "sleep level 1 keeps a copy of float weights only, and this model's are in the kernels' tiles "
                "(GGUF, --quantization, or a mixture of experts' experts): use level 2, which loads them again "
                "on wake-up"
            )

    def sleep(self, level: int) -> None:
        """Free the KV cache; level 1 also moves the weights off the device, level 2 drops them."""
        self.check_sleep(level)

        def go() -> None:
            runner = self.runner
            # What was built over the weights and the caches goes first: CUDA
            # graphs and the CPU step program hold their addresses, and the
            # program's numpy views would keep the old weights resident.
            runner.decode_graphs = None
            runner.cpu_program = None
            runner.kv_caches = []
            assert runner.model is not None
            if level == 1:
                self._stash = WeightStash(runner.model, runner.device)
            else:
                drop_weights(runner.model)
            release_freed_memory(runner.device)

        self._on_runner_thread(go)
        self._sleep_level = level

    def wake_up(self, num_blocks: int) -> None:
        """Weights back (level 1: from the stash; level 2: from the checkpoint), KV cache re-created."""
        if not self._sleep_level:
            return

        def go() -> None:
            runner = self.runner
            if self._stash is not None:
                assert runner.model is not None
                self._stash.restore(runner.model)
                self._stash = None
            else:
                runner.model = None
                release_freed_memory(runner.device)
                runner.load_model()
            runner.initialize_kv_cache(num_blocks)

        self._on_runner_thread(go)
        self._sleep_level = 0

    def memory_usage(self) -> MemoryUsage:
        runner = self.runner
        caches = list({t.data_ptr(): t for pair in runner.kv_caches for t in pair}.values())  # (groups share them)
        return MemoryUsage(
            rss_bytes=resident_bytes(),
            device_bytes=device_bytes(runner.device),
            kv_cache_bytes=tensor_bytes(caches),
            weights_bytes=weight_bytes(runner.model) if runner.model is not None else 0,
        )

    # ----------------------------------------------------------- LoRA adapters

    def has_lora(self, lora_id: int) -> bool:
        """Whether the runner holds the adapter now (read from any thread: a dict look-up)."""
        lora = self.runner.lora
        return lora is not None and lora_id in lora.loaded

    def add_lora(self, request: LoRARequest, in_use: set[int]) -> bool:
        return self._on_runner_thread(lambda: self.runner.add_lora(request, in_use))

    def remove_lora(self, lora_id: int) -> bool:
        return self._on_runner_thread(lambda: self.runner.remove_lora(lora_id))

    def pin_lora(self, lora_id: int, in_use: set[int]) -> bool:
        return self._on_runner_thread(lambda: self.runner.pin_lora(lora_id, in_use))

    def lora_name(self, lora_id: int) -> str | None:
        return self._on_runner_thread(lambda: self.runner.lora_name(lora_id))

    def list_loras(self) -> list[int]:
        return self._on_runner_thread(self.runner.list_loras)

    # ---------------------------------------------------------- collective RPC

    def collective_rpc(
        self, method: str, args: list[Any] | None = None, kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Call a whitelisted worker method on every worker (here, the one): one result each.

        Only the methods of ``COLLECTIVE_RPC_METHODS`` may be called; results
        must be plain data (they cross to the frontend as msgpack).
        """
        if method not in COLLECTIVE_RPC_METHODS:
            allowed = ", ".join(sorted(COLLECTIVE_RPC_METHODS))
            raise ValueError(f"collective_rpc method {method!r} is not allowed; allowed: {allowed}")
        fn = getattr(self, f"_rpc_{method}")
        return [self._on_runner_thread(lambda: fn(*(args or ()), **(kwargs or {})))]

    def _rpc_check_health(self) -> str:
        if self.runner.model is None:
            raise RuntimeError("the model is not loaded")
        return "ok"

    def _rpc_memory_usage(self) -> dict[str, int]:
        return msgspec.structs.asdict(self.memory_usage())

    def _rpc_reload_weights(self, model_dir: str | None = None) -> dict[str, Any]:
        """Load a checkpoint of the same architecture into the running model. For weight
        updates between a pause and a resume.

        Float parameters are copied in place (they keep their storage: CUDA graphs
        stay valid). Block-format weights (GGUF, ``--quantization``) are numpy arrays
        the layers hold, not parameters: the model loaded from the checkpoint then
        replaces the running one, and the CPU step program is rebuilt over it."""
        if self._sleep_level:
            raise RuntimeError("the engine is asleep: wake it up before reloading weights")
        runner = self.runner
        assert runner.model is not None
        start = time.perf_counter()
        config = runner.config if model_dir is None else msgspec.structs.replace(runner.config, model=model_dir)
        model = load_model(config, runner.device, runner.dtype)
        if block_weights(model) or block_weights(runner.model):
            runner.replace_model(model)
        else:
            fresh = dict(model.named_parameters())
            for name, param in runner.model.named_parameters():
                param.data.copy_(fresh[name])
            runner.model.prepare_for_inference()
        return {"model": config.model, "seconds": round(time.perf_counter() - start, 3)}

    def shutdown(self) -> None:
        if self._worker is not None:
            # A batch still in flight finishes before the tensors go away.
            self._worker.shutdown(wait=True)
            self._worker = None
        self.runner.decode_graphs = None  # graphs hold the caches' addresses and their own pool
        self.runner.kv_caches = []
        self.runner.model = None
        if self._stash is not None:
            self._stash.discard()
            self._stash = None


# Worker methods POST /collective_rpc may call (``UniProcExecutor._rpc_<name>``).
COLLECTIVE_RPC_METHODS = frozenset({"check_health", "memory_usage", "reload_weights"})
