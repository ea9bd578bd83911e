"""AsyncLLM: the frontend's engine handle (tokenize, send, detokenize, stream).

One output-handler task pulls EngineCoreOutputs off the engine client,
detokenizes them in the OutputProcessor and pushes deltas into per-request
collectors; each ``generate()`` caller awaits its own collector. Stop strings
found by the detokenizer are aborted in the engine, and a caller that goes
away (client disconnect: the generator is closed or cancelled) aborts its
request so the engine stops spending compute on it.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncGenerator

from app.input_processor import InputProcessor
from app.tokenizer import load_tokenizer
from app.output_processor import OutputProcessor, RequestOutput, RequestOutputCollector
from core.client import AsyncEngineCoreClient, AsyncInprocClient, AsyncMPClient
from core.config import EngineConfig
from core.protocol import EngineCoreRequest, EngineDeadError, SchedulerStats

logger = logging.getLogger("ringllm.frontend")


class AsyncLLM:
    """``in_process`` runs the EngineCore on this event loop instead of in its
    own process (``AsyncInprocClient``): no IPC, for tests of the layers above."""

    def __init__(
        self,
        config: EngineConfig,
        chat_template: str | None = None,
        *,
        in_process: bool = False,
        engine_core: AsyncMPClient | None = None,
    ) -> None:
        """``engine_core``: an engine process already started (``AsyncMPClient(config,
        wait=False)``), which this waits for."""
        self.config = config = config.resolve()
        assert config.tokenizer is not None and config.served_model_name is not None
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
        self.served_model_name = config.served_model_name
        self.chat_template = chat_template
        self.input_processor = InputProcessor.from_config(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._output_handler: asyncio.Task | None = None

    @property
    def is_dead(self) -> bool:
        return self.engine_core.engine_dead is not None

    def _ensure_output_handler(self) -> None:
        if self._output_handler is None:
            self._output_handler = asyncio.get_running_loop().create_task(self._run_output_handler())

    async def _run_output_handler(self) -> None:
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                reqs_to_abort = self.output_processor.process_outputs(outputs.outputs, outputs.logprobs)
                if reqs_to_abort:
                    await self.engine_core.abort_requests_async(reqs_to_abort)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            dead = exc if isinstance(exc, EngineDeadError) else EngineDeadError(str(exc))
            logger.error("output handler stopped: %s", dead)
            self.output_processor.propagate_error(dead)

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
        finished = False
        try:
            await self.engine_core.add_request_async(request)
            while not finished:
                out = collector.get_nowait() or await collector.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                await self._abort_quietly(request.request_id)

    async def _abort_quietly(self, request_id: str) -> None:
        self.output_processor.abort_requests([request_id])
        if self.engine_core.engine_dead is None:
            try:
                await self.engine_core.abort_requests_async([request_id])
            except EngineDeadError:
                pass

    async def get_scheduler_stats(self) -> SchedulerStats:
        return await self.engine_core.get_scheduler_stats_async()

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Empty the engine's prefix cache; False when refused (requests are
        running and ``reset_running_requests`` was not given)."""
        return await self.engine_core.reset_prefix_cache_async(reset_running_requests)

    def shutdown(self) -> None:
        if self._output_handler is not None:
            self._output_handler.cancel()
        self.engine_core.shutdown()
