"""Start and stop a real ``python -m app`` server process (benchmarks, tests, scripts).

The server runs as a subprocess of this interpreter on a free local port,
with its output in a log file; it is ready once ``/health`` answers 200. If
it exits or stays unhealthy, ``ServerStartError`` says so with the end of
its log, so that a caller (``bench sweep``) can report it and go on. The
standard library only: the server's dependencies do not include an HTTP client.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the tree that holds this app (a checkout), where `python -m app` runs
LOG_TAIL_LINES = 15
STOP_TIMEOUT_S = 30.0
# A local server: no proxy from the environment.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerStartError(RuntimeError):
    pass


_HANDED_OUT: set[int] = set()  # ports free_port returned in this process


def free_port() -> int:
    """A local port nothing listens on now, and one this process has not handed out before:
    the kernel may offer a port again as soon as the probe closes, and two servers launched side
    by side (bench sweep) would then both bind it, the loser failing only when it starts to listen."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def healthy(base_url: str, timeout: float = 1.0) -> bool:
    """Whether ``base_url``/health answers 200 now."""
    try:
        with _NO_PROXY.open(base_url + "/health", timeout=timeout) as response:
            return response.status == 200
    except (OSError, http.client.HTTPException):  # refused, timed out, an error status, a broken answer
        return False


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class ManagedServer:
    """``with ManagedServer(args, log_path) as server: ... server.base_url ...``"""

    def __init__(self, args: list[str], log_path: Path, timeout: float = 300.0, tree: Path = REPO) -> None:
        """``tree``: the source tree whose ``app`` runs (another checkout, for an A/B of two versions)."""
        self.args = args
        self.log_path = log_path
        self.timeout = timeout
        self.tree = tree
        self.proc: subprocess.Popen | None = None
        self.base_url = ""
        self._deadline = 0.0
        self._launched = 0.0
        self.ready_s: float | None = None  # seconds from launch to /health answering 200

    def command(self, port: int) -> list[str]:
        """The command line of a server listening on ``port``."""
        return [sys.executable, "-m", "app", "--host", "127.0.0.1", "--port", str(port), *self.args]

    def launch(self) -> ManagedServer:
        """Start the process and return at once (see ``wait_ready``)."""
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(port), cwd=self.tree, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self._launched = time.monotonic()
        self._deadline = self._launched + self.timeout
        return self

    def wait_ready(self) -> ManagedServer:
        """Block until /health answers 200; ServerStartError if the process exits or the time is up."""
        assert self.proc is not None, "launch() first"
        while time.monotonic() < self._deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"server exited with code {self.proc.returncode}:\n{log_tail(self.log_path)}"
                )
            if healthy(self.base_url):
                self.ready_s = time.monotonic() - self._launched
                return self
            time.sleep(0.05)
        self.stop()
        raise ServerStartError(f"server not healthy after {self.timeout:.0f} s:\n{log_tail(self.log_path)}")

    def start(self) -> ManagedServer:
        return self.launch().wait_ready()

    def stop(self) -> None:
        """SIGTERM (graceful shutdown of server and engine), SIGKILL if it hangs."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ManagedServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
