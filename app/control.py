"""Control routes, named and shaped as vLLM's: pause/resume, sleep/wake_up, collective_rpc.

- ``POST /pause?mode=abort|wait|keep&clear_cache=true``, ``POST /resume``,
  ``GET /is_paused``: always served. /pause returns once the pause is in
  effect: "abort" has finished the requests in flight (their clients get
  what was generated, with finish_reason "abort"), "wait" has let them
  finish, "keep" has frozen them with their KV cache. Requests that arrive
  while paused wait and run after /resume.
- ``POST /sleep?level=1|2&mode=abort|wait|keep``, ``POST /wake_up``,
  ``GET /is_sleeping``: only with ``--enable-sleep-mode``. Completions
  asked for while asleep get a 503.
- ``POST /collective_rpc`` with ``{"method": ..., "args": [...], "kwargs": {...}}``:
  only with ``--enable-dev-endpoints``, for the executor methods of
  ``core.worker.executor.COLLECTIVE_RPC_METHODS``.

The server wraps every one of them in its API-key check.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec
from msgspec.structs import asdict
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.errors import BadRequestError
from app.serving import EngineClient, json_response
from core.protocol import PAUSE_MODES, MemoryUsage, SleepResult

Endpoint = Callable[[Request], Awaitable[Response]]


class ControlClient(EngineClient, Protocol):
    """What the control routes and /metrics need of the engine (``AsyncLLM``)."""

    sleeping: bool

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = False) -> None: ...

    async def resume_generation(self) -> None: ...

    async def is_paused(self) -> bool: ...

    async def sleep(self, level: int = 1, mode: str = "abort") -> SleepResult: ...

    async def wake_up(self) -> MemoryUsage: ...

    async def is_sleeping(self) -> bool: ...

    async def collective_rpc(
        self, method: str, args: list[Any] | None = None, kwargs: dict[str, Any] | None = None
    ) -> list[Any]: ...

    def render_metrics(self) -> tuple[bytes, str]: ...


class CollectiveRpcBody(msgspec.Struct, forbid_unknown_fields=True):
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    timeout: float | None = None  # vLLM's field; accepted, not used (the call waits for its result)


def _mode(request: Request) -> str:
    mode = request.query_params.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise BadRequestError(f"mode must be one of {', '.join(PAUSE_MODES)}, not {mode!r}.", "mode")
    return mode


def _flag(request: Request, name: str, default: bool) -> bool:
    value = request.query_params.get(name)
    if value is None:
        return default
    if value.lower() not in ("true", "false", "1", "0"):
        raise BadRequestError(f"{name} must be true or false.", name)
    return value.lower() in ("true", "1")


async def _engine_call(call: Awaitable[Any]) -> Any:
    """An engine utility that refused (wrong state, unknown method) is the caller's error."""
    try:
        return await call
    except RuntimeError as exc:
        raise BadRequestError(str(exc)) from None


def _elapsed_ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 2)


def control_routes(
    engine: ControlClient,
    wrap: Callable[[Endpoint], Endpoint],
    *,
    enable_sleep_mode: bool = False,
    enable_dev_endpoints: bool = False,
) -> list[Route]:
    """The control routes this configuration serves, each wrapped by ``wrap`` (auth, errors)."""

    async def pause(request: Request) -> Response:
        mode = _mode(request)
        start = time.perf_counter()
        await _engine_call(engine.pause_generation(mode, _flag(request, "clear_cache", True)))
        return json_response({"status": "paused", "mode": mode, "elapsed_ms": _elapsed_ms(start)})

    async def resume(request: Request) -> Response:
        await _engine_call(engine.resume_generation())
        return json_response({"status": "resumed"})

    async def is_paused(request: Request) -> Response:
        return json_response({"is_paused": await engine.is_paused()})

    async def sleep(request: Request) -> Response:
        try:
            level = int(request.query_params.get("level", "1"))
        except ValueError:
            level = 0
        if level not in (1, 2):
            raise BadRequestError("level must be 1 or 2.", "level")
        start = time.perf_counter()
        result: SleepResult = await _engine_call(engine.sleep(level, _mode(request)))
        return json_response({
            "status": "sleeping",
            "level": level,
            "elapsed_ms": _elapsed_ms(start),
            "memory": {"before": asdict(result.before), "after": asdict(result.after)},
        })

    async def wake_up(request: Request) -> Response:
        start = time.perf_counter()
        memory = await _engine_call(engine.wake_up())
        return json_response({"status": "awake", "elapsed_ms": _elapsed_ms(start), "memory": asdict(memory)})

    async def is_sleeping(request: Request) -> Response:
        return json_response({"is_sleeping": await engine.is_sleeping()})

    async def collective_rpc(request: Request) -> Response:
        try:
            body = msgspec.json.decode(await request.body(), type=CollectiveRpcBody)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise BadRequestError(f"Invalid request: {exc}") from None
        results = await _engine_call(engine.collective_rpc(body.method, body.args, body.kwargs))
        return json_response({"results": results})

    routes = [
        Route("/pause", wrap(pause), methods=["POST"]),
        Route("/resume", wrap(resume), methods=["POST"]),
        Route("/is_paused", wrap(is_paused), methods=["GET"]),
    ]
    if enable_sleep_mode:
        routes += [
            Route("/sleep", wrap(sleep), methods=["POST"]),
            Route("/wake_up", wrap(wake_up), methods=["POST"]),
            Route("/is_sleeping", wrap(is_sleeping), methods=["GET"]),
        ]
    if enable_dev_endpoints:
        routes.append(Route("/collective_rpc", wrap(collective_rpc), methods=["POST"]))
    return routes
