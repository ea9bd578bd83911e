"""Control routes, named and shaped as vLLM's, each one a utility call (core/utilities.py).

- ``POST /pause?mode=abort|wait|keep&clear_cache=true``, ``POST /resume``,
  ``GET /is_paused``: always served. /pause returns once the pause is in
  effect: "abort" has finished the requests in flight (their clients get
  what was generated, with finish_reason "abort"), "wait" has let them
  finish, "keep" has frozen them with their KV cache. Requests that arrive
  while paused wait and run after /resume.
- ``POST /reset_prefix_cache?reset_running_requests=true``: empty the prefix
  cache; 409 while requests run unless they may be preempted.
- ``POST /sleep?level=1|2&mode=abort|wait|keep``, ``POST /wake_up``,
  ``GET /is_sleeping``: only with ``--enable-sleep-mode``. Completions
  asked for while asleep get a 503.
- ``POST /collective_rpc`` with ``{"method": ..., "args": [...], "kwargs": {...}}``:
  only with ``--enable-dev-endpoints``, for the executor methods of
  ``core.worker.executor.COLLECTIVE_RPC_METHODS``.

A route's arguments are its utility's: read from the query string (or the
JSON body) into the utility's argument Struct, so a bad value is a 400 that
names the parameter, and the engine receives them typed. The server wraps
every route in its API-key check.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
from msgspec.structs import asdict
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.errors import BadRequestError, ConflictError
from app.serving.base import EngineClient, json_response
from core.utilities import (
    COLLECTIVE_RPC,
    IS_SCHEDULER_PAUSED,
    IS_SLEEPING,
    PAUSE_SCHEDULER,
    RESET_PREFIX_CACHE,
    RESUME_SCHEDULER,
    SLEEP,
    WAKE_UP,
    Call,
    Utility,
    UtilityArgs,
)

Endpoint = Callable[[Request], Awaitable[Response]]
Reply = Callable[[Any, Any, float], dict[str, Any]]  # (arguments, result, elapsed ms) -> JSON body


class ControlClient(EngineClient, Protocol):
    """What the control routes and /metrics need of the engine (``AsyncLLM``)."""

    sleeping: bool

    async def call(self, call: Call[Any]) -> Any: ...

    def render_metrics(self) -> tuple[bytes, str]: ...


@dataclass(frozen=True)
class ControlRoute:
    path: str
    method: str  # GET | POST
    utility: Utility[Any]
    reply: Reply
    gate: str | None = None  # "sleep" (--enable-sleep-mode), "dev" (--enable-dev-endpoints), or always
    from_body: bool = False  # arguments in a JSON body rather than the query string


def _reset_reply(args: Any, reset: bool, elapsed_ms: float) -> dict[str, Any]:
    if not reset:
        raise ConflictError(
            "The prefix cache was not reset because requests are running; retry when the "
            "engine is idle, or pass reset_running_requests=true to preempt them."
        )
    return {"status": "reset", "elapsed_ms": elapsed_ms}


def _sleep_reply(args: Any, result: Any, elapsed_ms: float) -> dict[str, Any]:
    return {
        "status": "sleeping", "level": args.level, "elapsed_ms": elapsed_ms,
        "memory": {"before": asdict(result.before), "after": asdict(result.after)},
    }


CONTROL_ROUTES = (
    ControlRoute("/pause", "POST", PAUSE_SCHEDULER,
                 lambda args, _, ms: {"status": "paused", "mode": args.mode, "elapsed_ms": ms}),
    ControlRoute("/resume", "POST", RESUME_SCHEDULER, lambda *_: {"status": "resumed"}),
    ControlRoute("/is_paused", "GET", IS_SCHEDULER_PAUSED, lambda _, paused, __: {"is_paused": paused}),
    ControlRoute("/reset_prefix_cache", "POST", RESET_PREFIX_CACHE, _reset_reply),
    ControlRoute("/sleep", "POST", SLEEP, _sleep_reply, gate="sleep"),
    ControlRoute("/wake_up", "POST", WAKE_UP,
                 lambda _, memory, ms: {"status": "awake", "elapsed_ms": ms, "memory": asdict(memory)}, gate="sleep"),
    ControlRoute("/is_sleeping", "GET", IS_SLEEPING, lambda _, asleep, __: {"is_sleeping": asleep}, gate="sleep"),
    ControlRoute("/collective_rpc", "POST", COLLECTIVE_RPC, lambda _, results, __: {"results": results},
                 gate="dev", from_body=True),
)

_FIELD = re.compile(r" - at `\$\.(\w+)`")


async def read_args(request: Request, route: ControlRoute) -> UtilityArgs:
    """The route's arguments, typed; a 400 naming the parameter when one is wrong."""
    try:
        if route.from_body:
            return msgspec.json.decode(await request.body(), type=route.utility.args)
        return msgspec.convert(dict(request.query_params), type=route.utility.args, strict=False)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        match = _FIELD.search(str(exc))
        param = match.group(1) if match else None
        detail = _FIELD.sub("", str(exc))
        raise BadRequestError(f"Invalid {param}: {detail}." if param else f"Invalid request: {detail}.", param) from None


def control_routes(
    engine: ControlClient,
    wrap: Callable[[Endpoint], Endpoint],
    *,
    enable_sleep_mode: bool = False,
    enable_dev_endpoints: bool = False,
) -> list[Route]:
    """The control routes this configuration serves, each wrapped by ``wrap`` (auth, errors)."""
    gates = {None: True, "sleep": enable_sleep_mode, "dev": enable_dev_endpoints}

    def endpoint(route: ControlRoute) -> Endpoint:
        async def handle(request: Request) -> Response:
            args = await read_args(request, route)
            start = time.perf_counter()
            try:
                result = await engine.call(Call(route.utility, args))
            except RuntimeError as exc:  # the engine refused (wrong state, a disallowed method)
                raise BadRequestError(str(exc)) from None
            elapsed_ms = round((time.perf_counter() - start) * 1000, 2)
            return json_response(route.reply(args, result, elapsed_ms))

        return handle

    return [
        Route(route.path, wrap(endpoint(route)), methods=[route.method])
        for route in CONTROL_ROUTES
        if gates[route.gate]
    ]
