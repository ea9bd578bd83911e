"""The frontend process's serving loop: the engine handle, the Starlette app, hypercorn.

``serve`` runs on a uvloop event loop in ``python -m app`` and in each API server
process of ``--api-server-count`` (app/api_servers.py). The engines are started
by the caller; this builds the web stack while they boot, serves until a signal
or the engines' death, and returns the process's exit code.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from functools import partial
from typing import TYPE_CHECKING

from app.frontend_config import FrontendConfig
from core.config import EngineConfig
from core.heap import freeze_startup_heap

if TYPE_CHECKING:
    from app.async_llm import AsyncLLM
    from core.client import AsyncMPClient
    from core.dp_client import DPAsyncMPClient

logger = logging.getLogger("ringllm")


async def _until_started(
    starting: asyncio.Future, stop: asyncio.Event, engine_core: AsyncMPClient | DPAsyncMPClient
) -> AsyncLLM | None:
    """The engine handle once every engine is ready; None if a signal came first. Then the
    engines are stopped, which ends their handshakes (a head waiting for headless engines
    that never come would otherwise wait out the start-up timeout)."""
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((starting, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if starting.done():
        return starting.result()
    for proc in engine_core.engine_processes():
        proc.terminate()
    try:
        await starting
    except Exception:  # noqa: BLE001 - the handshake fails now, as it should
        pass
    return None


async def serve(
    config: EngineConfig,
    engine_core: AsyncMPClient | DPAsyncMPClient,
    frontend: FrontendConfig,
    sock: socket.socket,
    client_index: int = 0,
) -> int:
    """Serve until a signal or the engine's death; the process's exit code.
    ``client_index``: which of several API server processes this is (app/api_servers.py)."""
    from app.async_llm import AsyncLLM
    from app.lifecycle import CLOSE_GRACE_S, Lifecycle

    loop = asyncio.get_running_loop()
    lifecycle = Lifecycle(engine_core, frontend.shutdown_timeout, frontend.keep_alive_on_engine_death)
    lifecycle.install_signal_handlers()

    # The engine process starts first and boots (torch, the model) while this
    # thread imports the web stack: start-up takes the longer of the two.
    starting = loop.run_in_executor(
        None,
        partial(
            AsyncLLM, config, frontend.chat_template, engine_core=engine_core,
            log_requests=frontend.enable_log_requests, max_log_len=frontend.max_log_len,
        ),
    )
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config as HypercornConfig

    from app.banner import format_banner
    from app.limits import Admission, ServerLimits, close_connections_on_client_eof
    from app.responses_store import ResponsesStore
    from app.server import build_app

    engine = await _until_started(starting, lifecycle.stop, engine_core)
    if engine is None:
        logger.info("stopped before the engines were ready")
        return lifecycle.exit_code
    model_aliases = frontend.served_model_names[1:]
    limits = ServerLimits(
        max_request_body_bytes=frontend.max_request_body_bytes,
        max_num_waiting=frontend.max_num_waiting,
        stream_stall_timeout=frontend.stream_stall_timeout,
    )
    admission = Admission(engine.config.scheduler_config.max_num_seqs, limits.max_num_waiting, limits.retry_after_s)
    try:
        app = build_app(
            engine, engine.served_model_name, engine.max_model_len, frontend.api_key, frontend.chat_template,
            # The chat page chats: a pooling model has nothing to say there.
            model_aliases=model_aliases, enable_ui=frontend.enable_ui and not engine.config.is_pooling,
            enable_sleep_mode=frontend.enable_sleep_mode, enable_dev_endpoints=frontend.enable_dev_endpoints,
            allow_runtime_lora_updating=frontend.allow_runtime_lora_updating,
            enable_auto_tool_choice=frontend.enable_auto_tool_choice, tool_call_parser=frontend.tool_call_parser,
            reasoning_parser=frontend.reasoning_parser,
            limits=limits, admission=admission, allowed_origins=frontend.allowed_origins,
            responses_store=ResponsesStore(
                frontend.responses_store, frontend.responses_store_max_count, frontend.responses_store_max_age
            ),
        )
        freeze_startup_heap()
        host, port = sock.getsockname()[:2]
        try:
            # Bound at start, listened on only now (connections are refused while the engine
            # boots): another server that bound the same port meanwhile may have listened first.
            sock.listen(frontend.backlog)
        except OSError as exc:
            logger.error("cannot listen on %s:%s: %s", host, port, exc)
            return 1
        hypercorn_config = HypercornConfig()
        hypercorn_config.bind = [f"fd://{sock.detach()}"]  # hypercorn owns the socket from here
        hypercorn_config.accesslog = None
        hypercorn_config.errorlog = logging.getLogger("hypercorn.error")  # through our handlers only
        # The drain is ours (app/lifecycle.py); hypercorn waits for its connections meanwhile.
        hypercorn_config.graceful_timeout = frontend.shutdown_timeout + CLOSE_GRACE_S
        hypercorn_config.h11_max_incomplete_size = frontend.max_header_bytes
        hypercorn_config.h2_max_header_list_size = frontend.max_header_bytes
        hypercorn_config.keep_alive_timeout = frontend.keep_alive_timeout
        hypercorn_config.backlog = frontend.backlog
        routes = {getattr(route, "path", "") for route in app.routes}
        if frontend.scale_out.api_server_count > 1:
            from app.server import tag_responses

            app = tag_responses(app, client_index)
        if client_index == 0:
            logger.info(
                "%s",
                format_banner(
                    model=engine.config.model,
                    served_names=[engine.served_model_name, *model_aliases],
                    ready=engine.engine_core.ready,
                    transport=engine.config.transport,
                    host=host,
                    port=port,
                    routes=routes,
                    engines=engine.data_parallel_size,
                    api_servers=frontend.scale_out.api_server_count,
                ),
            )
        lifecycle.serving(engine, admission)
        close_connections_on_client_eof()  # hypercorn 0.18 would hold them till keep_alive_timeout
        server = asyncio.ensure_future(
            hypercorn_serve(app, hypercorn_config, shutdown_trigger=lifecycle.stop.wait)  # type: ignore[arg-type]
        )
        await lifecycle.run_server(server)
        return lifecycle.exit_code
    finally:
        logger.info("shutting down")
        engine.shutdown()
        # Hand the frozen start-up heap back to the collector, so that the
        # interpreter's teardown frees it (extensions report leaks otherwise).
        gc.unfreeze()
