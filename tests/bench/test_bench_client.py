"""bench.client: which SSE messages count as content, usage, errors (canned HTTP responses)."""

from __future__ import annotations

import asyncio
import json

import httpx

from bench.client import RequestResult, build_payload, stream_request


def sse(*events: object) -> bytes:
    return b"".join(
        b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n" for e in events
    )


def run(body: bytes, payload: dict, status: int = 200) -> RequestResult:
    def handler(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content) == payload
        return httpx.Response(status, content=body, headers={"content-type": "text/event-stream"})

    async def go() -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await stream_request(client, "http://test/v1/x", payload, prompt_len=3)

    return asyncio.run(go())


def chunk(text: str | None = None, delta: dict | None = None, usage: dict | None = None) -> dict:
    choices = [] if text is None and delta is None else [{"index": 0, "text": text, "delta": delta}]
    return {"choices": choices, "usage": usage}


def test_payloads_follow_the_endpoint() -> None:
    p = build_payload("/v1/completions", "m", "hi", 5, True, {"temperature": 0.0})
    assert p == {"model": "m", "stream": True, "stream_options": {"include_usage": True},
                 "prompt": "hi", "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    c = build_payload("/v1/chat/completions", "m", "hi", 5, False, extra_body={"top_k": 3})
    assert c["messages"] == [{"role": "user", "content": "hi"}]
    assert c["max_completion_tokens"] == 5 and c["top_k"] == 3 and "ignore_eos" not in c


def test_completion_stream_counts_content_chunks_and_reads_usage() -> None:
    payload = build_payload("/v1/completions", "m", "p", 3, False)
    body = sse(chunk("a"), chunk(""), chunk("bc"), chunk("d"), chunk(usage={"completion_tokens": 4}), "[DONE]")
    r = run(body, payload)
    assert r.success and r.error == ""
    assert r.generated_text == "abcd"
    assert len(r.itl) == 2  # three content chunks; the empty one is not content
    assert r.output_tokens == 4 and r.prompt_len == 3
    assert 0 < r.ttft <= r.latency


def test_chat_role_chunk_is_not_the_first_token() -> None:
    payload = build_payload("/v1/chat/completions", "m", "p", 3, False)
    body = sse(
        chunk(delta={"role": "assistant", "content": ""}),
        chunk(delta={"content": "x"}),
        chunk(delta={"content": "y"}),
        chunk(delta={}),
        chunk(usage={"completion_tokens": 2}),
        "[DONE]",
    )
    r = run(body, payload)
    assert r.success and r.generated_text == "xy" and len(r.itl) == 1 and r.output_tokens == 2


def test_failures_keep_their_reason() -> None:
    payload = build_payload("/v1/completions", "m", "p", 3, False)
    bad = run(b'{"error": {"message": "bad model"}}', payload, status=404)
    assert not bad.success and bad.error.startswith("HTTP 404") and "bad model" in bad.error
    mid = run(sse(chunk("a"), {"error": {"message": "engine died"}}), payload)
    assert not mid.success and "engine died" in mid.error and mid.generated_text == "a"
    empty = run(sse(chunk(usage={"completion_tokens": 0}), "[DONE]"), payload)
    assert not empty.success and "without any content" in empty.error
