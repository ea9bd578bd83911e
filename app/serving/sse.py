"""Server-sent events: the chunks of a streamed response, and a response that stops when the client leaves.

A client that hangs up is noticed by one watcher, ``until_disconnect``, for
streamed and whole responses alike (app/server.py uses it for both).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, TypeVar

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app.errors import StreamTimeoutError

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
DONE_EVENT = b"data: [DONE]\n\n"


def sse_event(body: Any) -> bytes:
    return b"data: " + _encoder.encode(body) + b"\n\n"


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run ``work`` until it ends or the client hangs up, whichever comes first.

    Returns ``(client_gone, result)``: when the client left first, ``work``
    was cancelled and the result is None (unless it had finished too).
    Exceptions of ``work`` propagate while the client is still there. Call
    only after the request body has been read: this consumes ``receive``.
    """
    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((work_task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work_task, watch):
            task.cancel()
        await asyncio.gather(work_task, watch, return_exceptions=True)
    gone = watch.done() and not watch.cancelled()
    if gone:
        finished = not work_task.cancelled() and work_task.exception() is None
        return True, work_task.result() if finished else None
    return False, work_task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(Response):
    """Server-sent events that stop as soon as the client goes away.

    The events are sent while ``until_disconnect`` watches for the client
    leaving; the generator is closed either way, so the request is aborted
    in the engine promptly instead of when the next send fails (or never,
    on a server that drops sends to closed connections silently).
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], stall_timeout: float | None = None) -> None:
        """``stall_timeout``: seconds the stream may go without an event before it is
        ended with an error event (and its requests aborted); None waits for ever."""
        # No Response.__init__: it would render a body and announce its length.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events
        self.stall_timeout = stall_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            await until_disconnect(receive, self._pump(send))
        finally:
            await self.events.aclose()

    async def _pump(self, send: Send) -> None:
        if self.stall_timeout is None:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
        else:
            while True:
                try:
                    event = await asyncio.wait_for(self.events.__anext__(), self.stall_timeout)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:  # the generator was cancelled: its requests are aborted
                    error = StreamTimeoutError(
                        f"No output for {self.stall_timeout:g} s (--stream-stall-timeout); the request was aborted."
                    )
                    event = sse_event(error.to_response())
                    await send({"type": "http.response.body", "body": event, "more_body": True})
                    break
                await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
