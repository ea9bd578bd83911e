"""Command-line arguments of ``python -m app``, named and grouped as in ``vllm serve``.

The engine's options are built from EngineArgs' fields (core/config.py: each
user-facing field's ``Knob``): name, default, type and help come from the
field, so each engine knob is written once. The frontend's own flags are
written here. The server binds 127.0.0.1 unless --host says otherwise
(vLLM binds every interface): exposing an unauthenticated model server to the
network should be a decision, not a default.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import types
import typing
from typing import Any

import msgspec

from app.frontend_config import (
    DEFAULT_BACKLOG,
    DEFAULT_DP_RPC_PORT,
    DEFAULT_HOST,
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_PORT,
    DEFAULT_RESPONSES_STORE_MAX_AGE_S,
    DEFAULT_RESPONSES_STORE_MAX_COUNT,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    FrontendConfig,
    ScaleOutConfig,
)
from app.parsing.detect import REASONING_CHOICES, TOOL_CALL_CHOICES
from core import envs
from core.config import EngineArgs, Knob, engine_knobs, parse_size, positive_int

# "org/name" as the Hugging Face hub spells a repository id.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")

# The --help sections in order, (title, description): engine knobs name theirs (Knob.group),
# the frontend's flags are added to them below.
_SECTIONS = (
    ("model", "what is served, and how it is loaded and prompted"),
    ("pooling", "embeddings, scores and classification instead of generated text"),
    ("structured outputs and tools", "response_format / structured_outputs, and tool calling on chat"),
    ("scheduler", "how requests share the engine's steps"),
    ("LoRA", "fine-tuned adapters served beside the base model"),
    ("cache", "the paged KV cache"),
    ("server", "HTTP, authentication and the chat page"),
    ("observability and control", "metrics at /metrics, log lines, and the control routes"),
    ("limits and shutdown", "what one request may cost, admission, and how the server stops"),
    ("transport", "between the frontend and the EngineCore process"),
    ("scale-out", "several EngineCore processes and API server processes"),
)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m app",
        description=(
            "ringllm: an OpenAI-compatible LLM server (vLLM V1's engine over shared-memory rings). "
            "Without --model it serves the embedded stories260K model, with a chat page at /."
        ),
    )
    sections = {title: p.add_argument_group(title, description) for title, description in _SECTIONS}
    for field, knob in engine_knobs():
        _add_knob(sections[knob.group], field, knob)

    sections["model"].add_argument(
        "--chat-template", metavar="FILE_OR_TEXT",
        help="chat template for /v1/chat/completions: a file path or the Jinja text itself "
        "(default: the tokenizer's own)",
    )

    structured = sections["structured outputs and tools"]
    structured.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help='accepted for vLLM\'s command lines and changes nothing: tool_choice "auto" always works',
    )
    structured.add_argument(
        "--tool-call-parser", choices=TOOL_CALL_CHOICES, default="auto",
        help="the syntax tool calls are read in under tool_choice auto: hermes (<tool_call>{...}</tool_call>: "
        "Hermes, Qwen2.5, Qwen3), llama3_json ({\"name\": ..., \"parameters\": ...}: Llama 3.x), mistral "
        "([TOOL_CALLS]...), qwen3_coder (<tool_call><function=...>); auto (default) reads it from the chat "
        "template, and a template with none of these answers tool_choice auto in plain text",
    )
    structured.add_argument(
        "--reasoning-parser", choices=REASONING_CHOICES, default="auto",
        help="how a thinking model's <think>...</think> is returned as reasoning_content: qwen3 or deepseek_r1 "
        "(alike here: the rendered prompt says whether the block is open); auto (default) when the chat "
        "template mentions <think>; none keeps it in the content",
    )

    sections["LoRA"].add_argument(
        "--allow-runtime-lora-updating", action="store_true",
        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING); they are behind --api-key like every route",
    )

    server = sections["server"]
    server.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})")
    server.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free port)"
    )
    server.add_argument(
        "--api-key",
        default=envs.RINGLLM_API_KEY,
        help="require 'Authorization: Bearer KEY' on the API (default: $RINGLLM_API_KEY, else no auth)",
    )
    server.add_argument(
        "--disable-frontend-ui", action="store_true",
        help="do not serve the chat page at / (the API is unchanged)",
    )
    server.add_argument(
        "--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
        help="let browser pages from these origins call the API (CORS), e.g. https://app.example.com, "
        "or * for any (default: none, no CORS headers)",
    )
    server.add_argument(
        "--responses-store", metavar="PATH",
        help="the SQLite file of stored responses (/v1/responses with store, previous_response_id), shared by "
        "every --api-server-count process and kept across restarts (default: responses.sqlite3 in $RINGLLM_CACHE)",
    )
    server.add_argument(
        "--responses-store-max-count", type=positive_int, default=DEFAULT_RESPONSES_STORE_MAX_COUNT, metavar="N",
        help="keep at most N stored responses, the oldest evicted first (default %(default)s)",
    )
    server.add_argument(
        "--responses-store-max-age", type=_positive_float, default=DEFAULT_RESPONSES_STORE_MAX_AGE_S,
        metavar="SECONDS", help="forget stored responses older than this (default 30 days)",
    )
    server.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"],
        help="logging threshold (default info)",
    )

    observe = sections["observability and control"]
    observe.add_argument(
        "--enable-log-requests", action="store_true",
        help="log a line when each request arrives and when it ends (ids, token counts, sampling "
        "parameters; not the prompt unless --max-log-len)",
    )
    observe.add_argument(
        "--max-log-len", type=int, default=0, metavar="CHARS",
        help="with --enable-log-requests, also log this many characters of each prompt (default 0: none)",
    )
    observe.add_argument(
        "--enable-dev-endpoints", action="store_true",
        help="serve POST /collective_rpc (whitelisted executor methods, e.g. reload_weights)",
    )

    limits = sections["limits and shutdown"]
    limits.add_argument(
        "--max-num-waiting", type=_non_negative_int, metavar="N",
        help="at most N requests queued beyond the --max-num-seqs running ones (counted by this "
        "frontend, in engine requests: n choices count n); more get a 503 with Retry-After "
        "(default: no limit)",
    )
    limits.add_argument(
        "--max-request-body-bytes", type=parse_size, default=DEFAULT_MAX_REQUEST_BODY_BYTES, metavar="BYTES",
        help="larger request bodies get a 413 before they are read whole (default 16MiB)",
    )
    limits.add_argument(
        "--max-header-bytes", type=parse_size, default=DEFAULT_MAX_HEADER_BYTES, metavar="BYTES",
        help="largest request line and headers accepted (HTTP/1.1), and header list (HTTP/2) (default 16KiB)",
    )
    limits.add_argument(
        "--keep-alive-timeout", type=float, default=DEFAULT_KEEP_ALIVE_TIMEOUT_S, metavar="SECONDS",
        help="close an idle keep-alive connection after this long (default 5)",
    )
    limits.add_argument(
        "--backlog", type=int, default=DEFAULT_BACKLOG, help=f"listen backlog (default {DEFAULT_BACKLOG})"
    )
    limits.add_argument(
        "--stream-stall-timeout", type=float, metavar="SECONDS",
        help="end a stream with an error event, aborting its request, when it has had nothing to "
        "send for this long (default: wait for ever; queued and paused requests count as stalled)",
    )
    limits.add_argument(
        "--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
        help="on SIGTERM or SIGINT, let requests in flight finish for this long, then abort them "
        "with an error; a second SIGINT exits at once (default 30)",
    )
    limits.add_argument(
        "--keep-alive-on-engine-death", action="store_true",
        help="when the EngineCore dies, stay up answering 503 instead of exiting with status 1",
    )

    parallel = sections["scale-out"]
    parallel.add_argument(
        "--restart-dead-engines", action="store_true",
        help="with -dp, start a dead engine again (its requests fail; the others serve meanwhile)",
    )
    parallel.add_argument(
        "--data-parallel-prefix-affinity", action="store_true",
        help="with -dp, send a request to the engine that got its longest prompt prefix before (it "
        "likely still caches it), unless that engine is much busier than the least loaded one",
    )
    parallel.add_argument(
        "--api-server-count", type=positive_int, default=1, metavar="M",
        help="API server processes sharing the port, each talking to every engine (default 1)",
    )
    parallel.add_argument(
        "--data-parallel-backend", choices=["mp", "ray"], default="mp",
        help="how engines start: mp (processes on this host, default) or ray (actors placed by Ray on "
        "the cluster at RAY_ADDRESS, one placement-group bundle each; engines on other nodes are "
        "reached over ZeroMQ/TCP); needs pip install 'ringllm[ray]'",
    )
    parallel.add_argument(
        "--data-parallel-start-rank", "-dpr", type=_non_negative_int, default=0, metavar="R",
        help="on a --headless host, the rank of its first engine",
    )
    parallel.add_argument(
        "--data-parallel-address", "-dpa", metavar="HOST",
        help="the head's address: where headless engines register and connect (TCP)",
    )
    parallel.add_argument(
        "--data-parallel-rpc-port", "-dpp", type=int, default=DEFAULT_DP_RPC_PORT, metavar="PORT",
        help=f"the head's registration port for headless engines (default {DEFAULT_DP_RPC_PORT})",
    )
    parallel.add_argument(
        "--headless", action="store_true",
        help="run only engines (ranks --data-parallel-start-rank ..), for the frontend at "
        "--data-parallel-address; no HTTP server",
    )
    parallel.add_argument(
        "--ray-engine-resources", type=_json_list_of_dicts, metavar="JSON",
        help='with the ray backend, extra Ray resources per engine, e.g. \'[{"node_a": 1}, {"node_b": 1}]\' '
        "to place engine 0 and engine 1 on the nodes offering them",
    )
    return p


def _add_knob(section: argparse._ArgumentGroup, field: msgspec.structs.FieldInfo, knob: Knob) -> None:
    """The option of one engine knob: ``--kebab-case`` of the field (or the knob's own flag,
    then its aliases), the field's default, shown in ``--help`` unless it is None (the help
    says what happens then), off or empty."""
    if field.required:
        default = None
    else:
        default = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
    flags = (knob.flag or "--" + field.name.replace("_", "-"), *knob.aliases)
    value_type = _value_type(field)
    options: dict[str, Any]
    if value_type is bool:
        if knob.flag is not None:  # a switch spelled as the opposite of its default: --disable-log-stats
            options = {"action": "store_false" if default else "store_true"}
        else:  # on by default: --x and --no-x; off: --x turns it on
            options = {"action": argparse.BooleanOptionalAction if default else "store_true"}
    else:
        options = {
            "type": knob.parse or _plain_parse(field.name, value_type),
            "choices": knob.choices,
            "metavar": knob.metavar,
            "nargs": knob.nargs,
        }
        if typing.get_origin(value_type) is list:
            options["action"] = "extend"  # repeated flags gather their values
    action = section.add_argument(*flags, dest=field.name, default=default, help=knob.help, **options)
    shown = isinstance(action, argparse.BooleanOptionalAction) or (
        default is not None and not isinstance(default, (bool, list))
    )
    if shown and "%(default)" not in action.help:  # argparse's BooleanOptionalAction adds it itself before 3.13
        action.help += " (default: %(default)s)"


def _value_type(field: msgspec.structs.FieldInfo) -> Any:
    """The field's type less its Knob and its None (``Annotated[int | None, Knob]``: int)."""
    value_type = typing.get_args(field.type)[0]
    if typing.get_origin(value_type) in (typing.Union, types.UnionType):
        given = [t for t in typing.get_args(value_type) if t is not type(None)]
        if len(given) == 1:
            return given[0]
    return value_type


def _plain_parse(name: str, value_type: Any) -> type | None:
    """argparse's ``type`` for a knob without a parse function: str stays text."""
    if value_type in (int, float):
        return value_type
    if value_type is str:
        return None
    raise TypeError(f"EngineArgs.{name}: a {value_type} knob needs a parse function in its Knob")


def _json_list_of_dicts(text: str) -> list[dict[str, float]]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, list) or not all(
        isinstance(d, dict) and all(isinstance(v, (int, float)) for v in d.values()) for d in value
    ):
        raise argparse.ArgumentTypeError("expected a JSON list of {resource: amount} objects")
    return value


def _positive_float(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return number


def _non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {number}")
    return number


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return make_parser().parse_args(argv)


def model_dir_error(model: str) -> str | None:
    """Why ``--model`` cannot be served, or None if it looks like a checkpoint directory.

    ringllm never downloads: a Hugging Face hub id gets a message saying how
    to fetch the checkpoint elsewhere and point at it, instead of a traceback
    from deep inside the loader.
    """
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")) and not any(
            name.endswith(".gguf") for name in os.listdir(model)
        ):
            return f"--model {model}: not a Hugging Face model directory (it has no config.json) nor one with a GGUF file"
        return None
    if os.path.isfile(model) and model.endswith(".gguf"):
        return None
    if os.path.exists(model):
        return f"--model {model}: not a directory or a .gguf file; give a local Hugging Face model directory"
    if _HUB_ID.fullmatch(model) and not model.startswith("."):
        return (
            f"--model {model}: no such directory. It looks like a Hugging Face hub id, but ringllm "
            "never downloads models: it serves local checkpoints only. On a machine with network "
            f"access run `hf download {model} --local-dir DIR` (or `huggingface-cli download`), "
            "bring DIR here, and start with --model DIR."
        )
    return f"--model {model}: no such directory; give a local Hugging Face model directory"


def served_model_names(args: argparse.Namespace) -> list[str]:
    """The names requests may use; the first is the one reported."""
    if args.served_model_name:
        return list(args.served_model_name)
    if args.model is None:
        from core.models.default_model import SERVED_NAMES

        return list(SERVED_NAMES)
    return [args.model]


def build_engine_args(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs from the parsed options (no --model: the embedded stories260K)."""
    given = {field.name: getattr(args, field.name) for field, _ in engine_knobs() if hasattr(args, field.name)}
    model = args.model
    if model is None:
        from core.models.default_model import default_model_dir

        model = default_model_dir()
    return EngineArgs(**{**given, "model": model, "served_model_name": served_model_names(args)[0]})


def load_chat_template(value: str | None) -> str | None:
    """--chat-template is a file path if such a file exists, else the template text."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if not any(c in value for c in "{}\n"):
        raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template either")
    return value


def build_frontend_config(args: argparse.Namespace) -> FrontendConfig:
    """The frontend's settings from the parsed options (ValueError/OSError for a
    --chat-template that names neither a file nor a template)."""
    return FrontendConfig(
        host=args.host,
        port=args.port,
        served_model_names=tuple(served_model_names(args)),
        api_key=args.api_key,
        chat_template=load_chat_template(args.chat_template),
        enable_ui=not args.disable_frontend_ui,
        allowed_origins=tuple(args.allowed_origins),
        log_level=args.log_level,
        enable_log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len,
        enable_sleep_mode=bool(args.enable_sleep_mode),
        enable_dev_endpoints=args.enable_dev_endpoints,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        responses_store=args.responses_store,
        responses_store_max_count=args.responses_store_max_count,
        responses_store_max_age=args.responses_store_max_age,
        max_num_waiting=args.max_num_waiting,
        max_request_body_bytes=args.max_request_body_bytes,
        max_header_bytes=args.max_header_bytes,
        keep_alive_timeout=args.keep_alive_timeout,
        backlog=args.backlog,
        stream_stall_timeout=args.stream_stall_timeout,
        shutdown_timeout=args.shutdown_timeout,
        keep_alive_on_engine_death=args.keep_alive_on_engine_death,
        scale_out=ScaleOutConfig(
            api_server_count=args.api_server_count,
            data_parallel_backend=args.data_parallel_backend,
            restart_dead_engines=args.restart_dead_engines,
            prefix_affinity=args.data_parallel_prefix_affinity,
            ray_engine_resources=None if args.ray_engine_resources is None else tuple(args.ray_engine_resources),
            headless=args.headless,
            data_parallel_start_rank=args.data_parallel_start_rank,
            data_parallel_address=args.data_parallel_address,
            data_parallel_rpc_port=args.data_parallel_rpc_port,
        ),
    )
