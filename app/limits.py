"""Admission and request limits, applied before a request costs anything.

A body is refused with 413 from its Content-Length, or as soon as the bytes
read pass the limit (a chunked upload is never buffered whole). Generation
requests are admitted against what this frontend already has in flight: it
sent every engine request itself, so it knows how many are running or
queued without asking the engine. Past ``max_num_seqs + max_num_waiting`` a
new request gets a 503 with ``Retry-After`` instead of a place in an
unbounded queue; while the server drains for shutdown every new generation
request gets one too. The middleware gives each HTTP request a
:class:`Ticket` and releases it when the response is complete (streams
included), however the request ends.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import OpenAIError, PayloadTooLargeError, ServiceUnavailableError

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20
DEFAULT_RETRY_AFTER_S = 1
TICKET_SCOPE_KEY = "ringllm.ticket"
# Before a 413, a body of up to this many times the limit is read to its end (and
# dropped, never kept): the HTTP server closes the connection once the response is
# sent, and a client still sending its body (most do not read before they are done)
# would see a reset connection instead of the 413. A larger body (at least 1 MiB is
# read) is refused at once.
DISCARD_FACTOR = 4
DISCARD_FLOOR_BYTES = 1 << 20


@dataclass(frozen=True)
class ServerLimits:
    """The HTTP-side limits of one server (the CLI's server flags)."""

    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_num_waiting: int | None = None  # None: no admission limit
    retry_after_s: int = DEFAULT_RETRY_AFTER_S
    stream_stall_timeout: float | None = None  # seconds without an event before a stream is ended


class Admission:
    """Engine requests in flight on this frontend, and whether new ones are taken."""

    def __init__(self, max_num_seqs: int, max_num_waiting: int | None, retry_after_s: int = DEFAULT_RETRY_AFTER_S):
        self.max_num_seqs = max_num_seqs
        self.max_num_waiting = max_num_waiting
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_waiting(self) -> int:
        """Requests beyond what the engine can run at once: queued there."""
        return max(0, self.in_flight - self.max_num_seqs)

    def ticket(self) -> Ticket:
        return Ticket(self)

    def _retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}

    def check(self, count: int) -> None:
        """ServiceUnavailableError if ``count`` more engine requests may not start now."""
        if self.draining:
            raise ServiceUnavailableError(
                "The server is shutting down and takes no new requests.", headers=self._retry_after()
            )
        limit = self.max_num_waiting
        # A request larger than the whole limit is still admitted when nothing else runs.
        if limit is not None and self.in_flight and self.in_flight + count > self.max_num_seqs + limit:
            raise ServiceUnavailableError(
                f"The server is at capacity ({self.in_flight} requests in flight, at most "
                f"{self.max_num_seqs} running and {limit} waiting); retry later.",
                headers=self._retry_after(),
            )

    def _add(self, count: int) -> None:
        self.in_flight += count
        if self.in_flight:
            self._idle.clear()
        else:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once nothing is in flight, False if ``timeout`` seconds pass first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


class Ticket:
    """One HTTP request's share of the admission count."""

    __slots__ = ("admission", "count")

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.count = 0

    def admit(self, count: int) -> None:
        """Take ``count`` engine requests, or raise a 503 (with Retry-After)."""
        self.admission.check(count)
        self.count += count
        self.admission._add(count)

    def release(self) -> None:
        if self.count:
            self.admission._add(-self.count)
            self.count = 0


def ticket_of(scope: Scope) -> Ticket | None:
    return scope.get(TICKET_SCOPE_KEY)


class LimitsMiddleware:
    """Pure ASGI (no buffering): the body limit, and a ticket per HTTP request."""

    def __init__(self, app: ASGIApp, admission: Admission, max_body_bytes: int) -> None:
        self.app = app
        self.admission = admission
        self.max_body_bytes = max_body_bytes
        self._discard_limit = max(DISCARD_FACTOR * max_body_bytes, DISCARD_FLOOR_BYTES)

    def _too_large(self) -> PayloadTooLargeError:
        return PayloadTooLargeError(
            f"The request body is larger than the server's limit of {self.max_body_bytes} bytes "
            "(--max-request-body-bytes)."
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            if declared <= self._discard_limit:
                await self._discard_body(receive, 0)
            await send_error(send, self._too_large(), close=True)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    if message.get("more_body", False):
                        await self._discard_body(receive, received)
                    raise self._too_large()  # the route turns it into a 413
            return message

        ticket = self.admission.ticket()
        scope[TICKET_SCOPE_KEY] = ticket
        try:
            await self.app(scope, limited_receive, send)
        finally:
            ticket.release()

    async def _discard_body(self, receive: Receive, received: int) -> None:
        """Read and drop the rest of a refused body, up to ``_discard_limit`` bytes in all."""
        while received <= self._discard_limit:
            message = await receive()
            if message["type"] != "http.request":
                return
            received += len(message.get("body", b""))
            if not message.get("more_body", False):
                return


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses it before we see it
    return None


async def send_error(send: Send, exc: OpenAIError, close: bool = False) -> None:
    """An OpenAI error response sent straight from ASGI (outside any route)."""
    body = msgspec.json.encode(exc.to_response())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    for name, value in (exc.headers or {}).items():
        headers.append((name.lower().encode(), value.encode()))
    await send({"type": "http.response.start", "status": int(exc.status), "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def close_connections_on_client_eof() -> None:
    """Make hypercorn close a connection as soon as its client has closed it.

    hypercorn 0.18's ``TCPServer`` ends its read loop on the client's EOF, but a
    connection that was idle still has its keep-alive timer running in the
    connection's task group, and the socket is closed only once that group is
    done: each connection a client closed while idle stays in CLOSE_WAIT, holding
    an fd, until ``keep_alive_timeout`` runs out. Stopping the timer when the
    read loop ends lets the connection close at once; one with a response still
    in progress closes when that ends, as before. Call once before serving;
    calling again does nothing.
    """
    from hypercorn.asyncio.tcp_server import TCPServer

    read_data = TCPServer._read_data
    if getattr(read_data, "stops_idle_timer", False):
        return

    async def _read_data(self: TCPServer) -> None:
        try:
            await read_data(self)
        finally:
            await self.idle_task.stop()

    _read_data.stops_idle_timer = True  # type: ignore[attr-defined]
    TCPServer._read_data = _read_data  # type: ignore[method-assign]
