"""``--api-server-count 2 -dp 2`` on a real server (stories260K): two API server processes
share the port and talk to both engines. Both answer (their pids differ, read from the
x-ringllm-api-server header), streams through either complete, /metrics (from either
process) counts every request exactly once, and SIGTERM stops everything cleanly."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.support.metrics import parse_metrics, value
from tests.support.servers import segments
from tests.support.waiting import DEADLINE_S

pytestmark = pytest.mark.slow

MODEL = "stories260K"


async def _stream_on_new_connection(base: str, i: int) -> tuple[str, str, int]:
    """(api server header, finish reason, completion tokens) of one streamed completion."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16 + i % 8, "ignore_eos": True,
            "temperature": 1.0, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:  # a connection of its own
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            server = response.headers["x-ringllm-api-server"]
            finish, tokens = "", 0
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                for choice in event["choices"]:
                    finish = choice["finish_reason"] or finish
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    return server, finish, tokens


@pytest.mark.alone
def test_two_api_servers_share_the_port_and_both_engines(server_factory) -> None:
    before = segments()
    server = server_factory(["--api-server-count", "2", "-dp", "2"])
    base = server.base_url

    async def wave(start: int) -> list[tuple[str, str, int]]:
        return await asyncio.gather(*(_stream_on_new_connection(base, start + i) for i in range(16)))

    # Waves until both processes have answered (usually the first): /health is ready once one
    # API server accepts, and the other may still be importing, so the bound is a deadline.
    results: list[tuple[str, str, int]] = []
    deadline = time.monotonic() + DEADLINE_S
    while len({r[0] for r in results}) < 2 and time.monotonic() < deadline:
        results += asyncio.run(wave(len(results)))
    servers = {r[0] for r in results}
    assert len(servers) == 2, servers
    indices = {s.split()[0] for s in servers}
    pids = {s.split("pid=")[1] for s in servers}
    assert indices == {"0", "1"} and len(pids) == 2
    for i, (_, finish, tokens) in enumerate(results):
        assert finish == "length" and tokens == 16 + i % 8

    # Each process's /metrics answers for both: every request counted once.
    answers = set()
    for _ in range(60):
        with httpx.Client(base_url=base, timeout=10) as client:  # new connections: both processes answer
            response = client.get("/metrics")
            answers.add(response.headers["x-ringllm-api-server"].split()[0])
            samples = parse_metrics(response.text)
        total = sum(
            value(samples, "vllm:request_success_total", engine=e, finished_reason="length", model_name=MODEL)
            for e in ("0", "1")
        )
        assert total == len(results)
        if len(answers) == 2:
            break
    assert answers == {"0", "1"}
    engines = httpx.get(base + "/engine/stats", timeout=10).json()["engines"]
    assert [e["status"] for e in engines] == ["serving", "serving"]

    server.stop()
    assert server.proc is not None and server.proc.returncode == 0
    assert segments() <= before
