"""Real ``python -m app`` server processes for integration tests."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from app.launcher import REPO, ManagedServer


def mapped_segments(pid: int, prefix: str = "/dev/shm/ringllm-") -> set[str]:
    """The shared-memory files under ``prefix`` a process has mapped (their paths, deleted
    or not); ``prefix="/dev/shm/"`` for every one (POSIX semaphores too)."""
    paths = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith(prefix):
            paths.add(parts[5].removesuffix(" (deleted)"))
    return paths


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    tree, i = [pid], 0
    while i < len(tree):
        for task in Path(f"/proc/{tree[i]}/task").iterdir():
            tree += [int(c) for c in (task / "children").read_text().split()]
        i += 1
    return tree


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def wait_gone(pid: int, seconds: float) -> bool:
    """Whether ``pid`` exits within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process_gone(pid):
            return True
        time.sleep(0.05)
    return process_gone(pid)


def segments() -> set[str]:
    """The ringllm segments and multiprocessing semaphores in /dev/shm now."""
    return {p.name for pattern in ("ringllm-*", "sem.mp-*") for p in Path("/dev/shm").glob(pattern)}


class Server(ManagedServer):
    """A real ``python -m app`` subprocess (app.launcher) plus what tests look at."""

    def openai(self) -> openai.OpenAI:
        """The official client on this server (no retries: a failure is the test's to see)."""
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def engine_stats(self) -> dict:
        """GET /engine/stats: the scheduler's counters (with data parallel, per engine under "engines")."""
        return httpx.get(self.base_url + "/engine/stats", timeout=10).json()

    def engine_pids(self) -> list[int]:
        """The server's children named EngineCore (core/engine_process.py's name_process)."""
        assert self.proc is not None
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        engines = []
        for pid in children:
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except FileNotFoundError:
                continue
            if name.startswith("EngineCore"):
                engines.append(int(pid))
        return engines

    def engine_pid(self) -> int:
        """The one EngineCore child (an early engine that did not become it is gone by now)."""
        (pid,) = self.engine_pids()
        return pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(args: list[str], log_path: Path, timeout: float = 120.0) -> Server:
    server = Server(args, log_path, timeout)
    try:
        return server.start()
    except BaseException:
        server.stop()
        raise


def stop_server(server: Server) -> None:
    server.stop()


def run_app(*args: str) -> subprocess.CompletedProcess:
    """``python -m app *args`` run to its end (for what exits at once: refusals, --help), its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "app", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )
