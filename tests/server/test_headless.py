"""A head and a ``--headless`` host (both on this machine, over TCP on 127.0.0.1):
the head runs engine 0, the headless host registers and runs engine 1, which talks to
the head's frontend over ZeroMQ/TCP. Both engines serve the same greedy text; killing
the headless engine takes only it out of routing; the head stops cleanly."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from app.launcher import REPO, free_port
from tests.support.servers import segments, wait_gone
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

BODY = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}


def test_an_engine_on_a_headless_host_serves_the_head(server_factory, tmp_path: Path) -> None:
    port = str(free_port())
    dp = ["-dp", "2", "-dpl", "1", "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", port]
    log_path = tmp_path / "headless.log"
    with open(log_path, "wb") as log:  # started first: it waits for the head
        headless = subprocess.Popen(
            [sys.executable, "-m", "app", "--headless", *dp, "--data-parallel-start-rank", "1"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        head = server_factory(dp)
        assert "engine 1 registered from a headless host" in head.log()
        texts = []
        for rank in (0, 1):
            done = httpx.post(head.base_url + "/v1/completions", json={**BODY, "data_parallel_rank": rank}, timeout=60)
            assert done.status_code == 200, done.text
            texts.append(done.json()["choices"][0]["text"])
        assert texts[0] == texts[1] and texts[0]

        engine_pid = int(re.search(r"engine 1 started \(pid (\d+)\)", log_path.read_text()).group(1))
        subprocess.run(["kill", "-9", str(engine_pid)], check=True)

        def engine1_down() -> bool:
            health = httpx.get(head.base_url + "/health", timeout=10).json()
            return health.get("engines", [{}, {}])[1].get("status") == "down"

        wait_for(engine1_down, "the head to see engine 1 gone")
        assert headless.wait(timeout=30) == 1  # its engine died
        done = httpx.post(head.base_url + "/v1/completions", json=BODY, timeout=60)
        assert done.json()["choices"][0]["text"] == texts[0]  # engine 0 serves on

        head.stop()
        assert head.proc is not None and head.proc.returncode == 0
        assert wait_gone(engine_pid, 5)
    finally:
        if headless.poll() is None:
            headless.kill()
            headless.wait()


@pytest.mark.alone
def test_a_head_stopped_while_it_waits_for_headless_engines_exits_at_once(tmp_path: Path) -> None:
    """SIGTERM before every engine is ready (here: one that never registers) stops the
    engines and exits 0 at once, with nothing left in /dev/shm."""
    before = segments()
    dp = ["-dp", "2", "-dpl", "1", "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port",
          str(free_port()), "--port", str(free_port())]
    log_path = tmp_path / "head.log"
    with open(log_path, "wb") as log:
        head = subprocess.Popen([sys.executable, "-m", "app", *dp], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "EngineCore 0 (pid" in log_path.read_text(), "the local engine to be ready")
        head.send_signal(signal.SIGTERM)
        assert head.wait(timeout=15) == 0
        assert "stopped before the engines were ready" in log_path.read_text()
        assert segments() <= before
    finally:
        if head.poll() is None:
            head.kill()
            head.wait()
