"""How a serving process stops: the drain on SIGTERM/SIGINT, and the EngineCore's death.

First signal: new generation requests get a 503 (and /health too, so a load
balancer moves away), hypercorn closes the listening socket and idle
keep-alive connections, and the requests in flight have ``shutdown_timeout``
seconds to finish. Those still running then end with an error (an error
event on a stream) and are aborted in the engine; the caller stops the
engine and exits 0. A second SIGINT exits at once (status 130): the engine
is killed and the transport's names removed, so nothing is left behind.

A dead EngineCore (crash, fault, OOM kill) cannot be recovered in place:
every stream has already ended with an error, so the server stops too and
exits 1, for a supervisor to restart it, unless told to stay up answering
503 (``--keep-alive-on-engine-death``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from app.errors import ServiceUnavailableError
from app.limits import Admission

if TYPE_CHECKING:
    from app.async_llm import AsyncLLM
    from core.client import AsyncMPClient
    from core.dp_client import DPAsyncMPClient

logger = logging.getLogger("ringllm")

ENGINE_WATCH_INTERVAL_S = 0.2
# After the drain, how long connections may take to close (a client that does not
# read can hold its connection open): then the HTTP server is cancelled.
CLOSE_GRACE_S = 5.0
EXIT_ENGINE_DEAD = 1
EXIT_SECOND_SIGINT = 130


class Lifecycle:
    """Owns the HTTP server's shutdown trigger and the process's exit code."""

    def __init__(
        self, engine_core: AsyncMPClient | DPAsyncMPClient, shutdown_timeout: float, keep_alive_on_engine_death: bool
    ) -> None:
        self.engine_core = engine_core
        self.shutdown_timeout = shutdown_timeout
        self.keep_alive_on_engine_death = keep_alive_on_engine_death
        self.stop = asyncio.Event()  # hypercorn's shutdown trigger
        self.exit_code = 0
        self.engine: AsyncLLM | None = None
        self.admission: Admission | None = None
        self._signals = 0
        self._tasks: set[asyncio.Task] = set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.on_signal, sig)

    def serving(self, engine: AsyncLLM, admission: Admission) -> None:
        """The server is up: signals now drain it, and the engine is watched."""
        self.engine, self.admission = engine, admission
        engine.start()
        self._spawn(self._watch_engine())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def on_signal(self, sig: int) -> None:
        self._signals += 1
        if self._signals == 1:
            logger.info("%s: shutting down", signal.Signals(sig).name)
            self._spawn(self._drain())
        elif sig == signal.SIGINT:
            self.exit_now()
        else:
            logger.info("%s again: already shutting down (SIGINT exits at once)", signal.Signals(sig).name)

    def exit_now(self) -> None:
        """Second SIGINT: no drain, no teardown; nothing left in /dev/shm or /tmp."""
        logger.warning("second SIGINT: exiting now")
        self.engine_core.kill_now()
        logging.shutdown()
        os._exit(EXIT_SECOND_SIGINT)

    async def _drain(self) -> None:
        admission, engine = self.admission, self.engine
        if admission is None or engine is None:  # still starting: nothing to drain
            self.stop.set()
            return
        admission.draining = True
        self.stop.set()  # hypercorn: stop listening, close idle connections
        logger.info(
            "draining %d requests for up to %gs (--shutdown-timeout)", admission.in_flight, self.shutdown_timeout
        )
        if not await admission.wait_idle(self.shutdown_timeout):
            count = engine.fail_all(
                ServiceUnavailableError("The server shut down before this request finished (--shutdown-timeout).")
            )
            logger.warning("shutdown timeout: aborted %d requests still in flight", count)

    async def _watch_engine(self) -> None:
        assert self.engine is not None and self.admission is not None
        while not self.engine.is_dead and not self.engine_core.is_gone():
            await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
        if self.stop.is_set():
            return  # our own shutdown stopped it
        if self.keep_alive_on_engine_death:
            logger.error("the EngineCore is dead; serving 503s (--keep-alive-on-engine-death)")
            return
        logger.error("the EngineCore is dead; the server exits with status %d", EXIT_ENGINE_DEAD)
        self.exit_code = EXIT_ENGINE_DEAD
        self.admission.draining = True
        self.stop.set()

    async def run_server(self, server: asyncio.Future) -> None:
        """Await the HTTP server; once it was told to stop, give its connections
        the drain plus ``CLOSE_GRACE_S``, then cancel it."""
        stop_wait = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait((server, stop_wait), return_when=asyncio.FIRST_COMPLETED)
            if not server.done():
                await asyncio.wait((server,), timeout=self.shutdown_timeout + CLOSE_GRACE_S)
            if not server.done():
                logger.warning("connections still open after the drain; closing them")
                server.cancel()
            try:
                await server
            except asyncio.CancelledError:
                pass
        finally:
            stop_wait.cancel()
            for task in list(self._tasks):
                task.cancel()
