"""The spawned EngineCore process's entry point: the process is set up before torch loads.

It must stay free of heavy imports: the frontend imports it to name the
spawn target, and the settings below only work if they are in place when
torch's thread pool (libgomp) is loaded.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from core.config import EngineConfig


def configure_cpu_threads() -> None:
    """Thread-pool settings for an engine that shares two or so cores with its frontend.

    The products run in OpenBLAS's pool (numpy), the rest in torch's OpenMP
    pool. By default OpenMP threads spin for a while after each parallel
    region, and on a small machine a spinning pool takes the very core the
    other pool (or the frontend) needs next: steps then take several times
    longer. ``OMP_WAIT_POLICY=PASSIVE`` makes them sleep at once. An explicit
    setting in the environment wins.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def set_thread_count(threads: int | None) -> None:
    """The math libraries' pool sizes (torch's OpenMP pool, OpenBLAS's), for an
    engine that shares the host with other data-parallel engines.

    The environment reaches the libraries loaded from now on (torch). numpy, and
    with it OpenBLAS, is usually loaded already, by the unpickling of this process's
    arguments: its pool is resized in place (threadpoolctl). Left at one thread per
    core, every engine's OpenBLAS threads spin on the same cores.
    """
    if threads is None:
        return
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    if "numpy" in sys.modules:
        from threadpoolctl import threadpool_limits

        threadpool_limits(threads, user_api="blas")


def use_one_blas_thread() -> None:
    """OpenBLAS on the calling process's one thread: for a model whose products all have
    small weights (kernels.linear.all_small), where a second thread gains nothing and
    its spinning takes a core from the frontend."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")


def run_engine_process(
    config: EngineConfig, transport_specs: Any, parent_pid: int, load_table: str | None = None
) -> None:
    """``transport_specs``: one per frontend (its client index is its position);
    ``load_table``: the shared-memory table this engine publishes its load in."""
    configure_cpu_threads()
    set_thread_count(config.engine_threads)
    from core.engine_core import run_engine_core

    run_engine_core(config, transport_specs, parent_pid, load_table)
