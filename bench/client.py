"""A streaming client for OpenAI-compatible completion endpoints, timed per SSE message.

Each server-sent event is timestamped as soon as it has been read. A *content
chunk* is an event whose first choice carries text (``text`` for completions,
``delta.content`` for chat); role-only or empty chunks, the usage chunk and
``[DONE]`` are not content. From those timestamps, as in ``vllm bench serve``:

- TTFT: from sending the request to the first content chunk;
- ITL: the gaps between consecutive content chunks;
- latency (E2EL): from sending the request to the last content chunk.

The number of output tokens comes from the ``usage`` chunk
(``stream_options.include_usage``). A request fails, with the reason kept, on
a non-200 status, an ``error`` event, a transport error, or a stream that ends
without any content.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import httpx

MAX_ERROR_BODY = 500


@dataclass
class RequestResult:
    """What one benchmark request measured (times in seconds, ``time.perf_counter`` clock)."""

    prompt_len: int
    success: bool = False
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int | None = None  # from usage; None when the server sent none
    generated_text: str = ""
    error: str = ""


def is_chat(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("/chat/completions")


def build_payload(
    endpoint: str, model: str, prompt: str, max_tokens: int, ignore_eos: bool,
    sampling: dict[str, Any] | None = None, extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON body of one streamed request, for a completions or a chat endpoint."""
    payload: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if is_chat(endpoint):
        payload["messages"] = [{"role": "user", "content": prompt}]
        payload["max_completion_tokens"] = max_tokens
    else:
        payload["prompt"] = prompt
        payload["max_tokens"] = max_tokens
    payload.update(sampling or {})
    if ignore_eos:
        payload["ignore_eos"] = True
    payload.update(extra_body or {})
    return payload


def auth_headers() -> dict[str, str]:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def make_http_client(max_connections: int | None = None) -> httpx.AsyncClient:
    """One pooled client for the whole run; no proxies from the environment, no timeouts but connect."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=30.0),
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        headers=auth_headers(),
        trust_env=False,
    )


def _content(data: dict[str, Any], chat: bool) -> str | None:
    """Text of the first choice of a chunk (None when the chunk has no choice)."""
    choices = data.get("choices")
    if not choices:
        return None
    first = choices[0]
    if chat:
        return (first.get("delta") or {}).get("content") or ""
    return first.get("text") or ""


class _StreamTimer:
    """Accumulates one response's content chunks and their arrival times."""

    def __init__(self, result: RequestResult, chat: bool) -> None:
        self.result = result
        self.chat = chat
        self.texts: list[str] = []
        self.last = 0.0

    def on_event(self, message: str, now: float) -> bool:
        """Take one event's data; False once the stream is over ([DONE] or an error event)."""
        if message == "[DONE]":
            return False
        data = json.loads(message)
        if data.get("error"):
            self.result.error = f"error event: {json.dumps(data['error'])[:MAX_ERROR_BODY]}"
            return False
        text = _content(data, self.chat)
        if text:
            if self.texts:
                self.result.itl.append(now - self.last)
            else:
                self.result.ttft = now - self.result.start_time
            self.texts.append(text)
            self.last = now
        usage = data.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            self.result.output_tokens = int(usage["completion_tokens"])
        return True

    def finish(self) -> RequestResult:
        result = self.result
        result.generated_text = "".join(self.texts)
        if result.error:
            return result
        if not self.texts:
            result.error = "the stream ended without any content chunk (no TTFT)"
            return result
        result.latency = self.last - result.start_time
        result.success = True
        return result


async def stream_request(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], prompt_len: int
) -> RequestResult:
    """Send one streaming request and time its content chunks."""
    result = RequestResult(prompt_len=prompt_len)
    timer = _StreamTimer(result, chat="messages" in payload)
    result.start_time = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")[:MAX_ERROR_BODY]
                result.error = f"HTTP {response.status_code}: {body}"
                return result
            data_lines: list[str] = []
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    data_lines.append(line[5:].lstrip())
                elif not line and data_lines:  # a blank line ends an event
                    message, data_lines = "\n".join(data_lines), []
                    if not timer.on_event(message, time.perf_counter()):
                        break
            else:
                if data_lines:  # a last event without its closing blank line
                    timer.on_event("\n".join(data_lines), time.perf_counter())
    except Exception:  # noqa: BLE001 - any failure is this request's result, kept with its reason
        result.error = traceback.format_exc(limit=3)
    return timer.finish()
