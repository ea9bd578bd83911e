"""The EngineCore process's entry points: the process is set up before torch loads.

It must stay free of heavy imports: the frontend imports it to name the
process's target (``python -m app`` first thing, to start an ``EarlyEngine``), and
the thread-pool settings (core/thread_pools.py) only work if they are in place
when torch's thread pool (libgomp) is loaded.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from core.thread_pools import configure_cpu_threads, set_thread_count

if TYPE_CHECKING:
    from core.config import EngineConfig
    from core.transport import TransportSpec


def run_engine_process(
    config: EngineConfig, transport_specs: Any, parent_pid: int, load_table: str | None = None
) -> None:
    """``transport_specs``: one per frontend (its client index is its position);
    ``load_table``: the shared-memory table this engine publishes its load in."""
    name_process(multiprocessing.current_process().name)
    configure_cpu_threads(encoder=config.model_config.encoder)
    set_thread_count(config.parallel_config.engine_threads)
    from core.engine_core import run_engine_core

    run_engine_core(config, transport_specs, parent_pid, load_table)


def run_engine_process_when_told(orders: Connection) -> None:
    """An EarlyEngine's process: torch and the engine's modules imported with the thread pools'
    defaults, then run_engine_process's arguments awaited on ``orders`` (EOF: stop)."""
    name_process("EngineCore")
    configure_cpu_threads()
    from core.engine_core import run_engine_core

    try:
        config, transport_specs, parent_pid, load_table = orders.recv()
    except EOFError:  # cancelled, or the frontend is gone
        return
    finally:
        orders.close()
    run_engine_core(config, transport_specs, parent_pid, load_table)


def name_process(name: str) -> None:
    """The process's name as ps, top and /proc/PID/comm show it (Linux; at most 15 bytes kept):
    an engine's command line is its frontend's or multiprocessing's, which name no role."""
    try:
        PR_SET_NAME = 15
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the name is cosmetic
        pass


class EarlyEngine:
    """The EngineCore process started before its config exists: it imports torch and the engine
    (most of a start-up) while the frontend parses its arguments and reads the model's files, and
    is then told its config, or stopped. An engine launcher (core/client.py's EngineLauncher) for
    the one local engine of a config that ``suits``."""

    frontend_host = "127.0.0.1"

    def __init__(self) -> None:
        # Forked while this process is still only the interpreter (python -m app's first step, one
        # thread, nothing loaded): the child starts at once, rather than after a fresh interpreter's
        # start and multiprocessing's resource tracker (a process of its own), which spawning
        # brings. Anywhere else it is spawned, as every other engine is.
        ctx = multiprocessing.get_context("fork" if threading.active_count() == 1 else "spawn")
        orders, self._orders = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=run_engine_process_when_told, args=(orders,), name="EngineCore", daemon=True)
        self.proc.start()
        orders.close()
        self.launched = False

    @staticmethod
    def suits(config: EngineConfig) -> bool:
        """Whether the thread pools it loaded torch with are this config's: an encoder's
        OpenMP threads wait differently, and engine_threads sizes the pools (core/thread_pools.py)."""
        return not config.model_config.encoder and config.parallel_config.engine_threads is None

    def is_local(self, engine_index: int) -> bool:
        return True

    def can_restart(self, engine_index: int) -> bool:
        return False

    def launch(self, config: EngineConfig, spec: TransportSpec, load_table: str | None) -> Any:
        """Tell the process its engine's config; the process, as spawn_engine's once started."""
        assert not self.launched and self.suits(config)
        self.launched = True
        try:
            self._orders.send((config, [spec], os.getpid(), load_table))
        except OSError:  # it died before it could be told
            from core.protocol import EngineStartError  # numpy and msgspec: not before the fork

            self.proc.join(5.0)
            raise EngineStartError(f"EngineCore died during start-up (exit code {self.proc.exitcode})") from None
        finally:
            self._orders.close()
        return self.proc

    def shutdown(self) -> None:
        """Stop the process unless it was launched (then its client stops it)."""
        if self.launched:
            return
        self.launched = True  # nothing to launch any more
        self._orders.close()
        self.proc.terminate()
        self.proc.join(5.0)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join()
