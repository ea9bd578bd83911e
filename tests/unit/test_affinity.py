"""The EngineCore's Python threads share one core; the math libraries' pools keep every core."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from core.affinity import engine_cpu

ALLOWED = sorted(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(len(ALLOWED) < 2, reason="placement needs at least two allowed cores")


def _thread_cpus(pid: int) -> dict[int, set[int]]:
    """Each thread of ``pid`` with the cores it may run on."""
    return {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def test_engine_cpu_setting() -> None:
    assert engine_cpu("off") is None
    if len(ALLOWED) >= 2:
        assert engine_cpu("auto") == ALLOWED[-1]
        assert engine_cpu(str(ALLOWED[0])) == ALLOWED[0]
        with pytest.raises(ValueError, match="may only use cores"):
            engine_cpu(str(max(ALLOWED) + 1000))
    else:
        assert engine_cpu("auto") is None


@needs_two_cores
@pytest.mark.slow
def test_engine_threads_on_one_core_pools_on_all(server_factory, stories_dir) -> None:
    server = server_factory(["--model", stories_dir])
    engine = server.engine_pid()
    threads = _thread_cpus(engine)
    # The busy loop (the main thread) and the I/O threads it started are on the last core...
    assert threads[engine] == {ALLOWED[-1]}
    pinned = [tid for tid, cpus in threads.items() if cpus == {ALLOWED[-1]}]
    assert len(pinned) >= 3, threads
    # ...while the OpenMP and OpenBLAS workers, created before the pin, may use them all.
    assert any(cpus == set(ALLOWED) for cpus in threads.values()), threads
    assert "EngineCore threads on core" in server.log()
    # The frontend is not pinned.
    assert os.sched_getaffinity(server.proc.pid) == set(ALLOWED)


@needs_two_cores
@pytest.mark.slow
def test_engine_cpu_off_leaves_placement_to_the_kernel(server_factory, stories_dir) -> None:
    server = server_factory(["--model", stories_dir, "--engine-cpu", "off"])
    assert all(cpus == set(ALLOWED) for cpus in _thread_cpus(server.engine_pid()).values())
    assert not Path(server.log_path).read_text().count("EngineCore threads on core")
