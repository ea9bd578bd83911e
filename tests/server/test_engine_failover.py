"""One of two data-parallel engines killed with SIGKILL, on real servers (stories260K).

Only the dead engine's streams fail (with an error event naming the engine), those running
and those waiting in it while the engines are paused; the other engine's complete, new
requests are served, /health names the dead engine; with --restart-dead-engines it comes
back under the same index and takes requests again.
Nothing is left in /dev/shm afterwards.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading

import httpx
import pytest

from tests.support.servers import segments, wait_gone
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

MODEL = "stories260K"
BODY = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
        "temperature": 1.0, "stream": True, "stream_options": {"include_usage": True}}


def _engine_pids(server) -> dict[int, int]:
    """Engine index -> pid of its latest incarnation, from the engines' start-up lines."""
    pids = {}
    for index, pid in re.findall(r"EngineCore (\d+) \(pid (\d+)\) ready", server.log()):
        pids[int(index)] = int(pid)
    return pids


class _Stream(threading.Thread):
    """Reads one streamed completion to its end: its finish reason, tokens, or error."""

    def __init__(self, base: str, rank: int, running: bool = True) -> None:
        """``running``: return once it has its first token (else once its response has begun:
        a request sent while the engines are paused waits in its engine)."""
        super().__init__(daemon=True)
        self.client = httpx.Client(base_url=base, timeout=60)
        self.response = self.client.send(
            self.client.build_request("POST", "/v1/completions", json={**BODY, "data_parallel_rank": rank}),
            stream=True,
        )
        assert self.response.status_code == 200
        self.lines = self.response.iter_lines()
        while running and not next(self.lines).startswith("data: "):
            pass
        self.tokens = 0
        self.finish: str | None = None
        self.error: dict | None = None

    def run(self) -> None:
        try:
            for line in self.lines:
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.error = event["error"]
                    break
                for choice in event["choices"]:
                    self.finish = choice["finish_reason"] or self.finish
                if event.get("usage"):
                    self.tokens = event["usage"]["completion_tokens"]
        finally:
            self.response.close()
            self.client.close()


def _complete(base: str, **extra) -> httpx.Response:
    body = {**BODY, "stream": False, "max_tokens": 16, **extra}
    del body["stream_options"]
    return httpx.post(base + "/v1/completions", json=body, timeout=60)


@pytest.mark.alone
def test_a_killed_engine_fails_only_its_own_requests(server_factory) -> None:
    before = segments()
    server = server_factory(["-dp", "2"])
    base = server.base_url
    pids = _engine_pids(server)
    assert sorted(pids) == [0, 1]

    # On each engine two requests mid-generation, frozen there by pause "keep", and one sent
    # while paused, waiting in its engine: none of the waiting ones can have ended first.
    running = {rank: [_Stream(base, rank) for _ in range(2)] for rank in (0, 1)}
    assert httpx.post(base + "/pause", params={"mode": "keep"}, timeout=10).status_code == 200
    waiting = {rank: _Stream(base, rank, running=False) for rank in (0, 1)}
    streams = {rank: [*running[rank], waiting[rank]] for rank in (0, 1)}
    for stream in streams[0] + streams[1]:
        stream.start()
    os.kill(pids[1], signal.SIGKILL)
    for stream in streams[1]:
        stream.join(timeout=60)
        assert not stream.is_alive(), "a stream of the dead engine is still open"
        if stream is not waiting[1] and stream.finish == "length":
            # It ran to its end before the pause took effect (the engine outpaced the client).
            assert stream.error is None and stream.tokens == BODY["max_tokens"]
            continue
        assert stream.error is not None, "a stream of the dead engine ended without an error"
        assert "engine 1 died" in stream.error["message"]
    assert httpx.post(base + "/resume", timeout=10).status_code == 200
    for stream in streams[0]:
        stream.join(timeout=60)
        assert stream.error is None and stream.finish == "length" and stream.tokens == BODY["max_tokens"]

    health = httpx.get(base + "/health", timeout=10)
    assert health.status_code == 200
    assert health.json() == {
        "status": "degraded",
        "engines": [{"index": 0, "status": "serving"}, {"index": 1, "status": "down"}],
    }
    for _ in range(4):  # unpinned requests go to the engine that is left
        assert _complete(base).json()["choices"][0]["finish_reason"] == "length"
    pinned = _complete(base, data_parallel_rank=1)
    assert pinned.status_code == 503 and pinned.json()["error"]["type"] == "ServiceUnavailableError"

    server.stop()
    assert server.proc is not None and server.proc.returncode == 0
    assert wait_gone(pids[0], 10)
    assert segments() <= before


@pytest.mark.alone
def test_a_dead_engine_is_restarted_and_serves_again(server_factory) -> None:
    before = segments()
    server = server_factory(["-dp", "2", "--restart-dead-engines"])
    base = server.base_url
    old = _engine_pids(server)
    os.kill(old[1], signal.SIGKILL)
    wait_for(lambda: _engine_pids(server).get(1, old[1]) != old[1], "engine 1 to start again")
    new = _engine_pids(server)
    assert new[0] == old[0]

    def both_serving() -> bool:
        return httpx.get(base + "/health", timeout=10).json().get("status") == "ok"

    wait_for(both_serving, "engine 1 to rejoin")
    for rank in (1, 0, None):
        extra = {} if rank is None else {"data_parallel_rank": rank}
        done = _complete(base, **extra)
        assert done.status_code == 200 and done.json()["choices"][0]["finish_reason"] == "length"
    stats = httpx.get(base + "/engine/stats", timeout=10).json()["engines"]
    assert [e["status"] for e in stats] == ["serving", "serving"]

    server.stop()
    assert server.proc is not None and server.proc.returncode == 0
    assert wait_gone(new[1], 10)
    assert segments() <= before


@pytest.mark.alone
def test_a_killed_frontend_leaves_nothing_behind(server_factory) -> None:
    """kill -9 of a -dp 2 server: both engines go with it (they watch their parent), and
    every name (rings, pools, load tables) was dropped once the engines were ready."""
    before = segments()
    server = server_factory(["-dp", "2"])
    pids = _engine_pids(server)
    assert server.proc is not None
    server.proc.kill()
    server.proc.wait(timeout=10)
    assert all(wait_gone(pid, 10) for pid in pids.values())
    assert segments() <= before
