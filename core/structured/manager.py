"""The EngineCore's StructuredOutputManager: compile pool, grammar cache, bitmasks.

Grammars compile on a small thread pool (xgrammar releases the GIL while it
compiles), submitted by whoever preprocesses requests: the engine process's
input thread, never its busy loop. A request waits in WAITING_FOR_FSM, which
the scheduler skips, until its future is done; ``on_ready`` then wakes
whoever drives the engine, so an engine with nothing else to do sleeps
instead of polling. Compiled grammars are cached by their ``GrammarKey``
(kind, spec, whitespace rules), futures included, so identical requests
arriving together compile once.

xgrammar itself (and its tokenizer info) is loaded on the first structured
request, on the pool: start-up and the requests without a grammar pay nothing.
Reading a vocabulary of 150k tokens for it frees several times what it keeps,
which is handed back to the system then (``trim_c_heap``).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from core.affinity import unpin_current_thread
from core.config import STRUCTURED_OUTPUTS_BACKENDS, EngineConfig
from core.heap import trim_c_heap
from core.protocol import StructuredOutputsParams
from core.structured.request import GrammarKey, StructuredOutputRequest

if TYPE_CHECKING:
    import torch

    from core.request import Request

logger = logging.getLogger("ringllm.structured")

# Compiled grammars kept (least recently used dropped first).
CACHE_SIZE = 256
COMPILE_THREADS = 2


class StructuredOutputManager:
    def __init__(self, config: EngineConfig) -> None:
        assert config.structured_outputs_config.backend in STRUCTURED_OUTPUTS_BACKENDS
        self.config = config
        self._backend: Any = None
        self._backend_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._cache_lock = threading.Lock()
        # Called from a pool thread when a grammar is ready (or failed).
        self.on_ready: Callable[[], None] | None = None
        self._compiled = threading.Event()

    # ------------------------------------------------------------ compile

    def new_request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """The request's grammar state; compilation starts now unless cached (ValueError
        for params that name no single constraint)."""
        max_whitespace = params.max_whitespace
        if max_whitespace is None:
            max_whitespace = self.config.structured_outputs_config.max_whitespace
        key = GrammarKey(params.kind(), params.spec(), not params.disable_any_whitespace, max_whitespace)
        with self._cache_lock:
            future = self._cache.get(key)
            submitted = future is None
            if future is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        COMPILE_THREADS, thread_name_prefix="GrammarCompile", initializer=unpin_current_thread
                    )
                future = self._pool.submit(self._compile, key)
                self._cache[key] = future
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        if submitted:
            # Outside the lock: a compile that already finished runs the callback right here,
            # and the callback takes the lock.
            future.add_done_callback(lambda done, key=key: self._compile_done(key, done))
        return StructuredOutputRequest(key, future, self._get_backend)

    def _get_backend(self) -> Any:
        backend = self._backend
        if backend is not None:
            return backend
        with self._backend_lock:
            if self._backend is None:
                from core.structured.xgrammar_backend import XgrammarBackend

                cfg = self.config
                self._backend = XgrammarBackend(cfg.tokenizer, cfg.model_config)
                trim_c_heap()
                logger.info("structured outputs: xgrammar ready (vocabulary of %d)", self._backend.vocab_size)
            return self._backend

    def _compile(self, key: GrammarKey) -> Any:
        return self._get_backend().compile(key)

    def _compile_done(self, key: GrammarKey, future: Future) -> None:
        if future.exception() is not None:
            with self._cache_lock:  # a failure is not worth keeping
                if self._cache.get(key) is future:
                    del self._cache[key]
        self._compiled.set()
        callback = self.on_ready
        if callback is not None:
            callback()

    def wait_for_compilation(self, timeout: float) -> None:
        """Block until some grammar finishes compiling, or ``timeout`` (offline driver)."""
        self._compiled.wait(timeout)
        self._compiled.clear()

    # ------------------------------------------------------------ steps

    def grammar_bitmask(
        self, requests: Sequence[Request], drafts: list[list[int]] | None = None, skips: list[int] | None = None
    ) -> torch.Tensor:
        """The next-token bitmask of each request (which have matchers), row i for requests[i];
        with ``drafts``, a row more for each of request i's drafts (after accepting the ones before);
        ``skips[i]`` rows allowing every token before request i's (rows still inside its reasoning)."""
        matchers = [r.structured.matcher for r in requests]  # type: ignore[union-attr]
        return self._get_backend().bitmask(matchers, drafts, skips)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
