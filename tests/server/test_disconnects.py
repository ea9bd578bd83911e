"""Clients that go away, on a real server (stories260K): before the first token, during a
non-streamed request, with a half-read stream; and a reader that stops reading, which
must not hold up anyone else. Each time the engine must drop the request (nothing
running or waiting, KV cache empty). /pause?mode=keep holds requests in the engine, so
that the client is surely gone before they could have finished."""

from __future__ import annotations

import httpx
import pytest

from tests.support.servers import Server
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

BODY = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def _wait_engine_empty(server: Server) -> None:
    def empty() -> bool:
        stats = server.engine_stats()
        return stats["num_running_reqs"] == stats["num_waiting_reqs"] == 0 and stats["kv_cache_usage"] == 0

    wait_for(empty, "the engine to drop every request and free its KV cache")


def _wait_waiting(server: Server, count: int) -> None:
    wait_for(lambda: server.engine_stats()["num_waiting_reqs"] == count, f"{count} requests waiting in the engine")


@pytest.fixture(scope="module")
def server(module_server_factory):
    return module_server_factory([])


def test_clients_gone_before_the_first_token_or_mid_request_are_dropped_by_the_engine(server) -> None:
    base = server.base_url
    assert httpx.post(base + "/pause", params={"mode": "keep"}, timeout=10).status_code == 200
    try:
        # A stream closed right after its headers, before any token.
        with httpx.stream("POST", base + "/v1/completions", json={**BODY, "stream": True}, timeout=30) as response:
            assert response.status_code == 200
            _wait_waiting(server, 1)
        _wait_waiting(server, 0)
        # A non-streamed request whose client gives up while it waits.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", json=BODY, timeout=httpx.Timeout(30, read=0.5))
        _wait_waiting(server, 0)
    finally:
        assert httpx.post(base + "/resume", timeout=10).status_code == 200
    _wait_engine_empty(server)


def test_a_reader_that_stops_reading_holds_up_no_one_and_is_dropped_when_it_leaves(server) -> None:
    base = server.base_url
    slow = httpx.Client(base_url=base, timeout=60)
    with slow.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as stalled:
        next(stalled.iter_lines())  # half-read: one line, then nothing
        for _ in range(3):  # others are served meanwhile, token for token
            done = httpx.post(base + "/v1/completions", json={**BODY, "max_tokens": 64}, timeout=60).json()
            assert done["choices"][0]["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 64
    slow.close()
    _wait_engine_empty(server)
