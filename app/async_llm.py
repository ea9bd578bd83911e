"""AsyncLLM: the frontend's engine handle (tokenize, send, detokenize, stream).

One output-handler task pulls EngineCoreOutputs off the engine client,
detokenizes them in the OutputProcessor and pushes deltas into per-request
collectors; each ``generate()`` caller awaits its own collector. Stop strings
found by the detokenizer are aborted in the engine, and a caller that goes
away (client disconnect: the generator is closed or cancelled) aborts its
request so the engine stops spending compute on it.

The same task feeds the metrics (app/metrics.py) from the engine's step
timestamps and scheduler snapshots; the control calls (pause, sleep,
collective_rpc...) are utility calls into the EngineCore (``call``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from app.input_processor import InputProcessor
from app.metrics import FrontendMetrics
from app.output_processor import OutputProcessor, RequestOutput, RequestOutputCollector
from app.stats_logger import RequestLogger, StatsLogger
from app.tokenizer import load_tokenizer
from core.client import AsyncEngineCoreClient, AsyncInprocClient, AsyncMPClient
from core.config import EngineConfig
from core.dp_client import DPAsyncMPClient
from core.protocol import EngineCoreRequest, EngineDeadError, EngineLostError
from core.utilities import IS_SLEEPING, SLEEP, WAKE_UP, Call

logger = logging.getLogger("ringllm.frontend")

R = TypeVar("R")


class AsyncLLM:
    """``in_process`` runs the EngineCore on this event loop instead of in its
    own process (``AsyncInprocClient``): no IPC, for tests of the layers above."""

    def __init__(
        self,
        config: EngineConfig,
        chat_template: str | None = None,
        *,
        in_process: bool = False,
        engine_core: AsyncMPClient | DPAsyncMPClient | None = None,
        log_requests: bool = False,
        max_log_len: int = 0,
        stats_interval: float | None = None,
    ) -> None:
        """``engine_core``: an engine process already started (``AsyncMPClient(config,
        wait=False)``), which this waits for. ``log_requests``/``max_log_len``:
        --enable-log-requests and how many prompt characters it may show;
        ``stats_interval``: seconds between stats lines (default from the environment, unless
        ``config.log_stats`` is off)."""
        self.config = config
        # The tokenizer loads on a thread while the engine boots: start-up takes
        # the longer of the two, not the sum.
        with ThreadPoolExecutor(1, thread_name_prefix="TokenizerLoad") as pool:
            tokenizer = pool.submit(load_tokenizer, config.tokenizer)
            if engine_core is not None:
                engine_core.wait_ready()
                self.engine_core: AsyncEngineCoreClient = engine_core
            else:
                self.engine_core = (AsyncInprocClient if in_process else AsyncMPClient)(config)
            self.tokenizer = tokenizer.result()
        self.max_model_len = self.engine_core.max_model_len
        self.data_parallel_size = config.parallel_config.data_parallel_size
        self.served_model_name = config.served_model_name
        self.chat_template = chat_template
        self.input_processor = InputProcessor.from_config(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._output_handler: asyncio.Task | None = None
        self.metrics = FrontendMetrics(
            self.served_model_name,
            self.max_model_len,
            {
                "block_size": config.cache_config.block_size,
                "num_gpu_blocks": self.engine_core.num_gpu_blocks,
                "enable_prefix_caching": config.cache_config.enable_prefix_caching,
                "cache_dtype": config.cache_config.kv_cache_dtype,
                "gpu_memory_utilization": config.cache_config.gpu_memory_utilization,
            },
            self.engine_core.transport_stats,
            log_stats=config.log_stats,
        )
        self.stats_logger = StatsLogger(self.metrics, stats_interval) if config.log_stats else None
        self._stats_task: asyncio.Task | None = None
        self.request_logger = RequestLogger(self.tokenizer, max_log_len) if log_requests else None
        # Set as a sleep starts and cleared by wake_up (``call``): the server
        # answers 503 meanwhile instead of queueing requests.
        self.sleeping = False

    @property
    def is_dead(self) -> bool:
        return self.engine_core.engine_dead is not None

    def engines_alive(self) -> list[bool]:
        """Per engine index (data parallel): is it serving."""
        return self.engine_core.engines_alive()

    def start(self) -> None:
        """On the serving loop: read the engine's outputs from now on (not only once a
        request came), so that an engine's death is seen, and handled, while idle."""
        self._ensure_output_handler()

    def _ensure_output_handler(self) -> None:
        if self._output_handler is None:
            loop = asyncio.get_running_loop()
            self._output_handler = loop.create_task(self._run_output_handler())
            if self.stats_logger is not None:
                self._stats_task = loop.create_task(self.stats_logger.run())

    async def _run_output_handler(self) -> None:
        metrics = self.metrics if self.config.log_stats else None
        try:
            while True:
                try:
                    outputs = await self.engine_core.get_output_async()
                except EngineLostError as lost:  # one data-parallel engine died: only its requests fail
                    self.output_processor.fail_requests(lost.request_ids, lost)
                    for request_id in lost.request_ids:
                        self.metrics.finish_request(request_id, "error", lost.engine_index)
                    continue
                reqs_to_abort = self.output_processor.process_outputs(outputs.outputs, outputs.logprobs)
                if metrics is not None:
                    metrics.record(outputs, reqs_to_abort)
                if reqs_to_abort:
                    await self.engine_core.abort_requests_async(reqs_to_abort)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            dead = exc if isinstance(exc, EngineDeadError) else EngineDeadError(str(exc))
            logger.error("output handler stopped: %s", dead)
            self.output_processor.propagate_error(dead)
            self.metrics.forget_requests()

    async def generate(self, request: EngineCoreRequest) -> AsyncGenerator[RequestOutput, None]:
        """Yield output deltas of one request until it finishes.

        Raises EngineDeadError if the engine dies meanwhile. Closing or
        cancelling the generator early aborts the request in the engine.
        """
        if self.engine_core.engine_dead is not None:
            raise self.engine_core.engine_dead
        self._ensure_output_handler()
        collector = RequestOutputCollector()
        self.output_processor.add_request(request, collector)
        if self.config.log_stats:
            self.metrics.add_request(request)
        if self.request_logger is not None:
            self.request_logger.received(request)
        finished = False
        out: RequestOutput | None = None
        try:
            await self.engine_core.add_request_async(request)
            while not finished:
                out = collector.get_nowait() or await collector.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.metrics.finish_request(request.request_id, "abort")
                await self._abort_quietly(request.request_id)
            if self.request_logger is not None:
                self.request_logger.finished(
                    request.request_id,
                    out.finish_reason if finished and out is not None else "abort",
                    out.num_output_tokens if out is not None else 0,
                )

    async def _abort_quietly(self, request_id: str) -> None:
        self.output_processor.abort_requests([request_id])
        if self.engine_core.engine_dead is None:
            try:
                await self.engine_core.abort_requests_async([request_id])
            except EngineDeadError:
                pass

    def fail_all(self, exc: BaseException) -> int:
        """End every unfinished request with ``exc`` (the shutdown drain ran out of
        time): streams send it as an error event, and each request is aborted in the
        engine as its generator closes. Returns how many there were."""
        count = len(self.output_processor.requests)
        self.output_processor.propagate_error(exc)
        return count

    async def call(self, call: Call[R]) -> R:
        """A utility call into the engine (core/utilities.py), whatever the number of engines.

        ``sleeping`` follows the engine's state: set as a sleep starts (so new
        requests get a 503 at once, not a queue slot), cleared by wake_up."""
        utility = call.utility
        was_sleeping = self.sleeping
        if utility is SLEEP:
            self.sleeping = True
        try:
            result = await self.engine_core.call_async(call)
        except BaseException:
            self.sleeping = was_sleeping
            raise
        if utility is WAKE_UP:
            self.sleeping = False
        elif utility is IS_SLEEPING:
            self.sleeping = bool(result)
        return result

    async def call_each(self, call: Call[R]) -> list[R | None]:
        """Data parallel: the call's result from each engine (None for one that is down)."""
        return await self.engine_core.call_each_async(call)

    def render_metrics(self) -> tuple[bytes, str]:
        """GET /metrics: the text exposition and its content type."""
        return self.metrics.render()

    def shutdown(self) -> None:
        for task in (self._output_handler, self._stats_task):
            if task is not None:
                task.cancel()
        self.engine_core.shutdown()
