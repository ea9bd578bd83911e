"""``python -m bench startup``: seconds from launching ``python -m app`` to ``/health`` answering 200.

Each run starts a fresh server process and polls ``/health`` over one kept-alive
connection every few milliseconds (a poller that spawns a process per try,
like a shell loop around curl, would itself load the machine it measures). The
median and spread over ``--repeats`` runs are printed; the server's own log
gives the phases (the engine's "EngineCore ready" line, the banner).
"""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import subprocess
import sys
import tempfile
import time

from app.launcher import REPO, free_port

HELP = "time from `python -m app` to /health 200"
POLL_S = 0.005


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("server_args", nargs=argparse.REMAINDER, help="arguments for python -m app (after --)")


def time_to_ready(server_args: list[str], timeout: float) -> float:
    port = free_port()
    with tempfile.TemporaryFile() as log:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "app", "--port", str(port), *server_args], cwd=REPO, stdout=log,
            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            while time.perf_counter() - start < timeout:
                try:
                    conn.request("GET", "/health")
                    response = conn.getresponse()
                    response.read()
                    if response.status == 200:
                        return time.perf_counter() - start
                except OSError:
                    conn.close()
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read().decode(errors='replace')}")
                time.sleep(POLL_S)
            raise TimeoutError(f"not ready after {timeout} s")
        finally:
            proc.terminate()
            proc.wait()


def run(args: argparse.Namespace) -> int:
    server_args = [a for a in args.server_args if a != "--"]
    times = [time_to_ready(server_args, args.timeout) for _ in range(args.repeats)]
    print(
        f"ready after (s): median {statistics.median(times):.2f}, min {min(times):.2f}, max {max(times):.2f} "
        f"over {len(times)} starts ({' '.join(f'{t:.2f}' for t in times)})"
    )
    return 0
