"""Where the EngineCore's Python threads run: all on one core.

The busy loop, the input thread and the output thread hand the GIL to each
other several times a step (a request in, a step's outputs out). On
different cores every handoff is a wake-up across cores with the GIL's
cache lines following it; on one core it is a plain switch between threads
that the kernel does at once. So, when the process may use two cores or
more, the engine moves its Python threads onto one of them (the last one
allowed, leaving the first ones to the frontend and the client) once the
math libraries' thread pools exist: those pools were created unpinned and
keep every core for the dense products and the parallel kernels.

``--engine-cpu off`` leaves placement to the kernel; ``--engine-cpu N``
names the core.
"""

from __future__ import annotations

import os

import torch

_all_cpus: frozenset[int] | None = None  # what the process could use before any pinning


def engine_cpu(setting: str, engine_index: int = 0) -> int | None:
    """The core for the engine's Python threads under ``setting`` (auto | off | a core
    number). With "auto", data-parallel engines take distinct cores from the last one down."""
    allowed = sorted(os.sched_getaffinity(0))
    if setting == "off" or len(allowed) < 2:
        return None
    if setting == "auto":
        return allowed[-1 - engine_index % len(allowed)]
    cpu = int(setting)
    if cpu not in allowed:
        raise ValueError(f"--engine-cpu {cpu}: this process may only use cores {allowed}")
    return cpu


def pin_engine_threads(setting: str, engine_index: int = 0) -> int | None:
    """Pin the calling thread (the busy loop's) to the engine's core; threads it
    starts afterwards inherit the placement. Call it after the model ran once."""
    global _all_cpus
    cpu = engine_cpu(setting, engine_index)
    if cpu is None:
        return None
    _all_cpus = frozenset(os.sched_getaffinity(0))
    # Make sure torch's intra-op pool exists before the pin: its threads would
    # otherwise be created from a pinned thread and share its one core.
    torch.ones(1 << 17).add_(1)
    os.sched_setaffinity(0, {cpu})
    return cpu


def unpin_current_thread() -> None:
    """Give a helper thread (started by a pinned one) every core back: for work that
    should not take turns with the busy loop, e.g. compiling grammars."""
    if _all_cpus is not None:
        os.sched_setaffinity(0, _all_cpus)
