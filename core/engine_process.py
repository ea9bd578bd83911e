"""The spawned EngineCore process's entry point: the process is set up before torch loads.

It must stay free of heavy imports: the frontend imports it to name the
spawn target, and the thread-pool settings (core/thread_pools.py) only work
if they are in place when torch's thread pool (libgomp) is loaded.
"""

from __future__ import annotations

from typing import Any

from core.config import EngineConfig
from core.thread_pools import configure_cpu_threads, set_thread_count


def run_engine_process(
    config: EngineConfig, transport_specs: Any, parent_pid: int, load_table: str | None = None
) -> None:
    """``transport_specs``: one per frontend (its client index is its position);
    ``load_table``: the shared-memory table this engine publishes its load in."""
    configure_cpu_threads(encoder=config.model_config.encoder)
    set_thread_count(config.parallel_config.engine_threads)
    from core.engine_core import run_engine_core

    run_engine_core(config, transport_specs, parent_pid, load_table)
