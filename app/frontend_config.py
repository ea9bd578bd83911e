"""What the frontend process is asked to do, resolved from the command line once (app/cli.py).

The engine's settings are core.config's EngineArgs; these are the rest: the
HTTP server, its limits and shutdown, and how many engines and API server
processes to start (scale-out). Plain frozen dataclasses: they are pickled
to the API server processes of ``--api-server-count``, and nothing below the
command line sees its argparse Namespace.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_HEADER_BYTES = 16 << 10
# The same as app.limits', which this module does not import: it is read before the engine
# is spawned, and app.limits brings asyncio and starlette (tests check the two agree).
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20
# hypercorn's default. A client should drop an idle connection before this (httpx's own
# default expiry is 5 s too, which invites the keep-alive race; bench soak uses half).
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0
DEFAULT_BACKLOG = 1024
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_DP_RPC_PORT = 29550
# Stored responses (/v1/responses with store: true): the most kept, and for how long (OpenAI: 30 days).
DEFAULT_RESPONSES_STORE_MAX_COUNT = 10_000
DEFAULT_RESPONSES_STORE_MAX_AGE_S = 30 * 24 * 3600.0


@dataclass(frozen=True)
class ScaleOutConfig:
    """Engines and API server processes beyond one of each (vLLM's flags)."""

    api_server_count: int = 1
    data_parallel_backend: str = "mp"  # mp | ray
    restart_dead_engines: bool = False
    prefix_affinity: bool = False
    ray_engine_resources: tuple[dict[str, float], ...] | None = None
    # Engines on several hosts (how many run here is EngineArgs.data_parallel_size_local):
    # the first rank here, the head's address and registration port.
    headless: bool = False
    data_parallel_start_rank: int = 0
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int = DEFAULT_DP_RPC_PORT


@dataclass(frozen=True)
class FrontendConfig:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    served_model_names: tuple[str, ...] = ()  # the first is reported, the others are accepted too
    api_key: str | None = None
    chat_template: str | None = None  # --chat-template's text, read from its file if it named one
    enable_ui: bool = True
    allowed_origins: tuple[str, ...] = ()
    log_level: str = "info"
    enable_log_requests: bool = False
    max_log_len: int = 0
    enable_sleep_mode: bool = False
    enable_dev_endpoints: bool = False
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    enable_auto_tool_choice: bool = False  # vLLM's switch: accepted, changes nothing
    tool_call_parser: str = "auto"  # app/parsing/detect.py: "auto" reads it from the chat template
    reasoning_parser: str = "auto"
    responses_store: str | None = None  # the SQLite file of stored responses (None: in the cache directory)
    responses_store_max_count: int = DEFAULT_RESPONSES_STORE_MAX_COUNT
    responses_store_max_age: float = DEFAULT_RESPONSES_STORE_MAX_AGE_S
    # Limits and shutdown.
    max_num_waiting: int | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S
    backlog: int = DEFAULT_BACKLOG
    stream_stall_timeout: float | None = None
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    keep_alive_on_engine_death: bool = False
    scale_out: ScaleOutConfig = ScaleOutConfig()
