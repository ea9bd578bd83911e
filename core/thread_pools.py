"""The math libraries' thread pools in an EngineCore process: how many threads, and how they wait.

Light on purpose (threadpoolctl is imported only when a pool is resized):
these settings must be in place before torch loads its OpenMP runtime, so
the engine process's entry point (core/engine_process.py) applies them first
thing. Where the engine's own Python threads run is core/affinity.py's
business.
"""

from __future__ import annotations

import os
import sys


def configure_cpu_threads(encoder: bool = False) -> None:
    """Thread-pool settings for an engine that shares two or so cores with its frontend.

    The products run in OpenBLAS's pool (numpy), the rest in torch's OpenMP
    pool. By default OpenMP threads spin for a while after each parallel
    region, and on a small machine a spinning pool takes the very core the
    other pool (or the frontend) needs next: steps then take several times
    longer. ``OMP_WAIT_POLICY=PASSIVE`` makes them sleep at once. An encoder
    (``encoder``) is the exception: its products run in torch's pool too, and
    its steps are long runs of large parallel regions, between which sleeping
    threads cost a wake-up each. An explicit setting in the environment wins.
    """
    if not encoder:
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
