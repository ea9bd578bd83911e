"""Graceful shutdown and faults, on real ``python -m app`` processes (stories260K):

- SIGTERM under streaming load: the streams in flight finish, new connections are
  refused, the server exits 0 and leaves no process and nothing in /dev/shm;
- the drain's timeout ends what is left with an error event; a second SIGINT exits at once;
- an exception inside the model step (RINGLLM_FAULT_INJECT, read by the executor):
  ENGINE_CORE_DEAD, every stream ends with an error, /health 503, exit status 1;
- a burst that fills the rings in both directions: nothing lost (count in = count out);
- a port another server listened on first while the engine booted: exit 1 with the reason;
- a frontend killed while its engine boots: the engine drops the transport's names and exits.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile

import httpx
import pytest

from app.launcher import REPO
from core.worker.faults import FAULT_ENV
from tests.support.servers import (
    Server,
    mapped_segments,
    process_gone,
    process_tree,
    segments,
)
from tests.support.waiting import wait_for, wait_until

pytestmark = pytest.mark.slow

STREAMS = 12
TOKENS = 96


class Watched:
    """A server with its engine's pid and shared-memory segments noted while it runs."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.engine_pid = server.engine_pid()
        self.segments = mapped_segments(self.engine_pid)
        assert len(self.segments) >= 4

    def wait_exit(self, timeout: float = 60) -> int:
        assert self.server.proc is not None
        return self.server.proc.wait(timeout=timeout)

    def assert_nothing_left(self) -> None:
        wait_for(lambda: process_gone(self.engine_pid), "the EngineCore to exit after its server")
        assert not any(os.path.exists(p) for p in self.segments)


async def _stream(base: str, max_tokens: int = TOKENS, started: asyncio.Event | None = None) -> dict:
    """One streamed completion: its finish reason, token count and any error event."""
    body = {
        "model": "stories260K", "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    result: dict = {"finish_reason": None, "tokens": None, "error": None}
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            if started is not None:
                started.set()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result["error"] = event["error"]
                    continue
                for choice in event["choices"]:
                    result["finish_reason"] = choice["finish_reason"] or result["finish_reason"]
                if event.get("usage"):
                    result["tokens"] = event["usage"]["completion_tokens"]
    return result


async def _streams_started(base: str, count: int, max_tokens: int = TOKENS) -> list[asyncio.Task]:
    """``count`` streams, returned once each has its response headers (it is admitted)."""
    events = [asyncio.Event() for _ in range(count)]
    tasks = [asyncio.create_task(_stream(base, max_tokens, e)) for e in events]
    for event, task in zip(events, tasks):
        waiter = asyncio.create_task(event.wait())
        await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
    return tasks


async def test_sigterm_lets_streams_in_flight_finish_then_exits_0_leaving_nothing(server_factory) -> None:
    server = Watched(server_factory(["--max-num-seqs", "8"]))  # some streams wait in the queue
    tasks = await _streams_started(server.server.base_url, STREAMS)
    server.server.proc.send_signal(signal.SIGTERM)
    results = await asyncio.gather(*tasks)
    assert all(r == {"finish_reason": "length", "tokens": TOKENS, "error": None} for r in results), results
    with pytest.raises(httpx.HTTPError):  # the listening socket is closed
        httpx.post(server.server.base_url + "/v1/completions", json={"prompt": "x"}, timeout=5)
    assert server.wait_exit() == 0
    server.assert_nothing_left()
    log = server.server.log()
    assert "draining" in log and "Traceback" not in log
    assert "leaked semaphore" not in log  # nothing of multiprocessing's left for its tracker


async def test_the_drain_timeout_ends_the_rest_with_an_error_event_and_a_second_sigint_exits_at_once(
    server_factory,
) -> None:
    # Paused with "keep", the streams cannot finish: the drain times out.
    server = Watched(server_factory(["--shutdown-timeout", "1"]))
    base = server.server.base_url
    tasks = await _streams_started(base, 3, max_tokens=400)
    async with httpx.AsyncClient(base_url=base) as client:
        assert (await client.post("/pause", params={"mode": "keep"})).status_code == 200
    server.server.proc.send_signal(signal.SIGTERM)
    results = await asyncio.gather(*tasks)
    for result in results:
        assert result["finish_reason"] is None and result["error"]["code"] == 503
        assert "--shutdown-timeout" in result["error"]["message"]
    assert server.wait_exit() == 0
    server.assert_nothing_left()

    server = Watched(server_factory(["--shutdown-timeout", "600"]))
    base = server.server.base_url
    tasks = await _streams_started(base, 1, max_tokens=400)
    async with httpx.AsyncClient(base_url=base) as client:
        assert (await client.post("/pause", params={"mode": "keep"})).status_code == 200
    server.server.proc.send_signal(signal.SIGINT)
    await wait_until(lambda: "draining" in server.server.log(), "the drain to begin")
    server.server.proc.send_signal(signal.SIGINT)
    assert server.wait_exit(timeout=30) == 130
    server.assert_nothing_left()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.alone
def test_a_port_another_server_listens_on_first_ends_this_one_with_the_reason_leaving_nothing() -> None:
    """The port is bound at start and listened on once the engine is ready (connections are
    refused while it boots). A server that bound the same port meanwhile and listened first,
    as two started side by side on one port do, makes this one exit 1 saying so: no banner
    claiming it is ready, no traceback, its engine and its rings gone."""
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the app binds: neither listens yet
    squatter.bind(("127.0.0.1", 0))
    port = squatter.getsockname()[1]
    before = segments()
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "--host", "127.0.0.1", "--port", str(port)], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # the engine logs once the app has bound its port and spawned it
            lines.append(line)
            if "[engine]" in line:
                squatter.listen()
                break
        lines += proc.stdout.readlines()
        assert proc.wait(timeout=300) == 1  # a loaded machine boots the engine slowly
    finally:
        proc.kill()
        squatter.close()
    log = "".join(lines)
    assert f"cannot listen on 127.0.0.1:{port}: [Errno 98] Address already in use" in log, log
    assert "ringllm is ready" not in log and "Traceback" not in log, log
    engine_pid = int(re.search(r"EngineCore 0 \(pid (\d+)\)", log).group(1))
    wait_for(lambda: process_gone(engine_pid), "the EngineCore to exit after its server")
    assert segments() - before == set()


@pytest.mark.parametrize("keep_alive", [False, True], ids=["exits", "keep-alive"])
async def test_a_fault_in_the_model_step_kills_the_engine_cleanly(server_factory, monkeypatch, keep_alive) -> None:
    monkeypatch.setenv(FAULT_ENV, "step:40")  # the server's engine inherits it
    server = Watched(server_factory(["--keep-alive-on-engine-death"] if keep_alive else []))
    base = server.server.base_url
    results = await asyncio.gather(*(_stream(base, 200) for _ in range(4)))
    for result in results:
        assert result["finish_reason"] is None and result["error"] is not None, result
        assert "dead" in result["error"]["message"] or "engine" in result["error"]["message"].lower()
    if keep_alive:
        async with httpx.AsyncClient(base_url=base) as client:
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == 503
            refused = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert 500 <= refused.status_code < 600 and "error" in refused.json()
        server.server.proc.send_signal(signal.SIGTERM)
        assert server.wait_exit() == 0
    else:
        assert server.wait_exit() == 1
    server.assert_nothing_left()
    log = server.server.log()
    assert "fault injected at model step 40" in log


async def test_a_frontend_killed_under_load_takes_its_engine_along_leaving_nothing(server_factory) -> None:
    server = Watched(server_factory([]))
    tasks = await _streams_started(server.server.base_url, 8, max_tokens=400)
    server.server.proc.kill()
    assert server.wait_exit() == -9
    server.assert_nothing_left()
    await asyncio.gather(*tasks, return_exceptions=True)  # cut off (or done, had they been quick)


@pytest.mark.alone
async def test_kill_9_of_every_server_process_leaves_nothing_in_dev_shm(server_factory) -> None:
    """SIGKILL to the frontend, the engine and multiprocessing's resource tracker at once (a
    process group killed by an OOM killer or a container stop): nothing they made in
    /dev/shm stays (ring segments, tables, a semaphore), since nobody is left to clean up."""
    before = segments()
    server = server_factory([])
    assert server.proc is not None
    pids = process_tree(server.proc.pid)
    assert len(pids) >= 2
    mapped = set().union(*(mapped_segments(pid) for pid in pids))
    assert mapped
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: all(process_gone(pid) for pid in pids), "every server process to exit")
    assert [path for path in mapped if os.path.exists(path)] == []
    assert segments() - before == set()


@pytest.mark.alone
def test_a_frontend_killed_while_its_engine_boots_leaves_nothing_in_dev_shm() -> None:
    """The frontend makes the rings and tensor pools, and drops their names once the engine says
    HELLO. SIGKILL to it before that (its engine still importing torch) left them in /dev/shm,
    hundreds of megabytes that nobody would remove: the engine, finding its frontend gone when
    it starts to serve, drops them, then exits."""
    def fifo_dirs() -> set[str]:  # the doorbells' FIFOs live in a directory of their own
        return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("ringllm-")}

    before, dirs_before = segments(), fifo_dirs()
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "--host", "127.0.0.1", "--port", "0"], cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: len({n for n in segments() - before if n.startswith("ringllm-pool-")}) == 2,
                 "the frontend to make its transport")
        children = process_tree(proc.pid)[1:]
        assert children  # the engine
        proc.kill()
        proc.wait()
    finally:
        proc.kill()
    wait_for(lambda: all(process_gone(pid) for pid in children), "the engine to exit after its frontend")
    assert segments() - before == set() and fifo_dirs() - dirs_before == set()
