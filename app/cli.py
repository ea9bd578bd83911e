"""Command-line arguments of ``python -m app``, named and grouped as in ``vllm serve``.

Engine options left unset keep EngineArgs' defaults, so the defaults live
in one place. The server binds 127.0.0.1 unless --host says otherwise
(vLLM binds every interface): exposing an unauthenticated model server to the
network should be a decision, not a default.
"""

from __future__ import annotations

import argparse
import json
import os
import re

import msgspec

from app.frontend_config import (
    DEFAULT_BACKLOG,
    DEFAULT_DP_RPC_PORT,
    DEFAULT_HOST,
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_PORT,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    FrontendConfig,
    ScaleOutConfig,
)
from core import envs
from core.config import (
    DEFAULT_JSON_MAX_WHITESPACE,
    EngineArgs,
    LoRAModule,
    SpeculativeConfig,
)
from core.pooler_config import PoolerConfig, parse_override

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
}
_DTYPE_ALIASES = {
    "half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16",
}
# "org/name" as the Hugging Face hub spells a repository id.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")

UNBOUNDED_WHITESPACE = -1  # --structured-outputs-max-whitespace none

# EngineArgs fields that map one to one onto an option of the same name.
_ENGINE_FIELDS = (
    "tokenizer", "dtype", "kv_cache_dtype", "device", "load_format", "quantization", "seed", "max_model_len",
    "block_size", "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
    "enable_prefix_caching", "num_gpu_blocks_override", "kv_cache_memory",
    "gpu_memory_utilization", "enforce_eager", "transport", "scheduling_policy", "enable_prompt_embeds",
    "async_scheduling", "enable_sleep_mode", "logprobs_mode", "structured_outputs_backend", "engine_cpu",
    "data_parallel_size", "engine_threads", "data_parallel_size_local", "speculative_config",
    "runner", "convert", "override_pooler_config", "enable_lora", "lora_modules", "max_loras", "max_lora_rank",
    "max_cpu_loras",
)


def parse_size(text: str) -> int:
    """Bytes from '268435456', '256MiB', '1.5G' (decimal k/M/G, binary KiB/MiB/GiB)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 536870912, 512MiB, 2G)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def _whitespace_bound(text: str) -> int:
    """A whitespace bound: a count >= 1, or "none" (UNBOUNDED_WHITESPACE)."""
    if text.lower() == "none":
        return UNBOUNDED_WHITESPACE
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"not a count of characters (at least 1) or 'none': {text!r}")
    return int(text)


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return msgspec.json.decode(text, type=SpeculativeConfig).resolved()
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"invalid speculative config {text!r}: {exc}") from None


def _lora_module(text: str) -> LoRAModule:
    """``name=path``, or vLLM's JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    if text.lstrip().startswith("{"):
        try:
            return msgspec.json.decode(text, type=LoRAModule)
        except msgspec.MsgspecError as exc:
            raise argparse.ArgumentTypeError(f"invalid LoRA module {text!r}: {exc}") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"invalid LoRA module {text!r}: expected name=path or JSON")
    return LoRAModule(name=name, path=path)


def _pooler_config(text: str) -> PoolerConfig:
    try:
        return parse_override(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _dtype(text: str) -> str:
    return _DTYPE_ALIASES.get(text, text)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m app",
        description=(
            "ringllm: an OpenAI-compatible LLM server (vLLM V1's engine over shared-memory rings). "
            "Without --model it serves the embedded stories260K model, with a chat page at /."
        ),
    )

    model = p.add_argument_group("model", "what is served, and how it is loaded and prompted")
    model.add_argument(
        "--model", metavar="DIR|FILE.gguf",
        help="local Hugging Face model directory (config.json, *.safetensors, tokenizer files), or a "
        "GGUF file (or a directory holding one), served quantized as it is; nothing is downloaded "
        "(default: the embedded stories260K)",
    )
    model.add_argument(
        "--served-model-name", nargs="+", metavar="NAME",
        help="model names clients use in requests: the first is the one /v1/models reports, the "
        "others are accepted as aliases (default: --model, or stories260K and ringllm-default)",
    )
    model.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory (default: --model)")
    model.add_argument(
        "--chat-template", metavar="FILE_OR_TEXT",
        help="chat template for /v1/chat/completions: a file path or the Jinja text itself "
        "(default: the tokenizer's own)",
    )
    model.add_argument(
        "--dtype", type=_dtype, choices=["auto", "float32", "float16", "bfloat16"],
        help="compute dtype (default auto: float32 on a CPU, the checkpoint's dtype on a GPU)",
    )
    model.add_argument(
        "--kv-cache-dtype", choices=["auto", "float32", "float16"],
        help="what the KV cache holds (default auto: float16 on a CPU under float32 compute, as "
        "llama.cpp's default f16 cache; else the compute dtype); float32 keeps a CPU's cache exact",
    )
    model.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], help="where the model runs (default auto: a GPU if any)"
    )
    model.add_argument(
        "--load-format", choices=["auto", "safetensors", "gguf", "dummy"],
        help="weights from the checkpoint (auto: safetensors, or gguf for a GGUF file) or seeded random "
        "ones of its shapes (dummy)",
    )
    model.add_argument(
        "--runner", choices=["auto", "generate", "pooling"],
        help="generate text, or pool (embeddings: /v1/embeddings; cross-encoders: /score, /rerank); "
        "default auto: pooling for checkpoints without a language-model head (BERT, RoBERTa, XLM-R "
        "encoders and their ...ForSequenceClassification, a headless LlamaModel), generate otherwise",
    )
    model.add_argument(
        "--convert", choices=["auto", "none", "embed", "classify"],
        help="serve a generative checkpoint as a pooling model: embed (last-token pooling unless the "
        "directory's sentence-transformers modules or --override-pooler-config say otherwise)",
    )
    model.add_argument(
        "--override-pooler-config", type=_pooler_config, metavar="JSON",
        help='a pooling model\'s pooler, over what its sentence-transformers modules say: '
        '{"pooling_type": "MEAN", "normalize": true} (LAST, MEAN, CLS or ALL)',
    )
    model.add_argument(
        "--quantization", choices=["q8_0", "q4_0"],
        help="quantize a Hugging Face checkpoint's layers and embedding at load, in llama.cpp's block "
        "format (CPU; a GGUF file keeps its own formats)",
    )
    model.add_argument("--seed", type=int, help="seed of random sampling and of dummy weights (default 0)")
    model.add_argument(
        "--max-model-len", type=int,
        help="context length: prompt plus completion tokens (default: the checkpoint's max_position_embeddings)",
    )
    model.add_argument("--enforce-eager", action="store_true", default=None, help="on a GPU, no CUDA graphs")
    model.add_argument(
        "--enable-prompt-embeds", action="store_true", default=None,
        help="accept prompt_embeds (base64 torch.save tensors) in /v1/completions",
    )

    model.add_argument(
        "--logprobs-mode", choices=["raw_logprobs", "processed_logprobs"],
        help="what returned logprobs describe: the model's raw logits (default) or the distribution "
        "sampled from, after penalties, temperature, min_p, top-k and top-p",
    )

    structured = p.add_argument_group(
        "structured outputs and tools", "response_format / structured_outputs, and tool calling on chat"
    )
    structured.add_argument(
        "--structured-outputs-backend", choices=["auto", "xgrammar"],
        help="grammar backend for JSON schema, regex, choice and grammar constraints: xgrammar is the "
        "only one implemented (auto picks it; default auto)",
    )
    structured.add_argument(
        "--structured-outputs-max-whitespace", type=_whitespace_bound, metavar="N|none",
        help="JSON schemas and json_object: the longest run of whitespace between two elements that "
        "a request without structured_outputs.max_whitespace may write; none lifts the bound "
        f"(default {DEFAULT_JSON_MAX_WHITESPACE})",
    )
    structured.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    structured.add_argument(
        "--tool-call-parser", choices=["hermes"],
        help="how tool calls are found in the text under tool_choice auto: hermes reads "
        "<tool_call>{...}</tool_call> blocks (Hermes, Qwen2.5, Qwen3 templates)",
    )

    sched = p.add_argument_group("scheduler", "how requests share the engine's steps")
    sched.add_argument("--max-num-seqs", type=int, help="most requests running at once (default 64)")
    sched.add_argument(
        "--max-num-batched-tokens", type=int, help="token budget of one engine step (default 2048)"
    )
    sched.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
        help="split long prompts over several steps, beside other requests' decodes (default on)",
    )
    sched.add_argument(
        "--scheduling-policy", choices=["fcfs", "priority"],
        help="waiting-queue order and preemption victim: arrival (default) or the request's priority",
    )
    sched.add_argument(
        "--async-scheduling", action="store_true", default=None,
        help="schedule the next batch while the model runs the current one",
    )
    sched.add_argument(
        "--speculative-config", type=_speculative_config, metavar="JSON",
        help='speculative decoding, as vLLM takes it: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5} proposes tokens that followed the same '
        "n-gram earlier in the request and verifies them in one step; disable_by_batch_size pauses it "
        "for batches that large (default: off)",
    )

    lora = p.add_argument_group("LoRA", "fine-tuned adapters served beside the base model")
    lora.add_argument(
        "--enable-lora", action="store_true", default=None,
        help="serve LoRA adapters (PEFT directories): a request picks one by its model name",
    )
    lora.add_argument(
        "--lora-modules", type=_lora_module, nargs="+", action="extend", metavar="NAME=PATH",
        help='adapters served from start-up: name=path, or {"name": ..., "path": ..., "base_model_name": ...}',
    )
    lora.add_argument(
        "--max-loras", type=_positive_int, metavar="N", help="most distinct adapters in one batch (default 1)"
    )
    lora.add_argument("--max-lora-rank", type=_positive_int, metavar="R", help="largest adapter rank accepted (default 16)")
    lora.add_argument(
        "--max-cpu-loras", type=_positive_int, metavar="N",
        help="adapters kept loaded; more are read again from their directory when used (default: --max-loras)",
    )
    lora.add_argument(
        "--allow-runtime-lora-updating", action="store_true",
        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING); they are behind --api-key like every route",
    )

    cache = p.add_argument_group("cache", "the paged KV cache")
    cache.add_argument("--block-size", type=int, help="tokens per KV cache block (default 16)")
    cache.add_argument(
        "--num-gpu-blocks-override", type=int, help="number of KV cache blocks, whatever the memory"
    )
    cache.add_argument(
        "--kv-cache-memory", type=parse_size, metavar="BYTES",
        help="bytes for the KV cache, e.g. 512MiB (default on a CPU: 4 GiB, at most a quarter of the memory "
        "available after the weights, at least 256 MiB and one max_model_len request, at most what max_num_seqs "
        "full-length requests use; on a GPU: measured)",
    )
    cache.add_argument(
        "--gpu-memory-utilization", type=float,
        help="fraction of GPU memory the engine may use, KV cache included (default 0.9)",
    )
    cache.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
        help="reuse the KV cache of shared prompt prefixes (default on)",
    )

    server = p.add_argument_group("server", "HTTP, authentication and the chat page")
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
        "--log-level", default="info", choices=["debug", "info", "warning", "error"],
        help="logging threshold (default info)",
    )

    observe = p.add_argument_group(
        "observability and control", "metrics at /metrics, log lines, and the control routes"
    )
    observe.add_argument(
        "--disable-log-stats", action="store_true",
        help="collect no engine statistics: no periodic stats line, and no vllm: series at /metrics "
        "(the ringllm: transport counters remain)",
    )
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
        "--enable-sleep-mode", action="store_true", default=None,
        help="serve POST /sleep, POST /wake_up and GET /is_sleeping (free the KV cache and weights while idle)",
    )
    observe.add_argument(
        "--enable-dev-endpoints", action="store_true",
        help="serve POST /collective_rpc (whitelisted executor methods, e.g. reload_weights)",
    )

    limits = p.add_argument_group(
        "limits and shutdown", "what one request may cost, admission, and how the server stops"
    )
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

    transport = p.add_argument_group("transport", "between the frontend and the EngineCore process")
    transport.add_argument(
        "--transport", choices=["shm", "zmq"],
        help="shared-memory rings (default shm) or vLLM's ZeroMQ sockets (the baseline)",
    )
    transport.add_argument(
        "--engine-cpu", metavar="{auto,off,N}", type=_engine_cpu,
        help="the core the EngineCore's Python threads share (its busy loop and I/O threads hand the GIL "
        "to each other every step, cheaply on one core): auto (default, the last core allowed), off "
        "(the kernel places them), or a core number; the math libraries' thread pools keep every core",
    )

    parallel = p.add_argument_group("scale-out", "several EngineCore processes and API server processes")
    parallel.add_argument(
        "--data-parallel-size", "-dp", type=_positive_int, metavar="N",
        help="EngineCore processes on this host, each with its own KV cache (the memory budget split "
        "between them); requests go to the least loaded one (default 1)",
    )
    parallel.add_argument(
        "--engine-threads", type=_positive_int, metavar="N",
        help="math-library threads per EngineCore (default: the cores split between the engines)",
    )
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
        "--api-server-count", type=_positive_int, default=1, metavar="M",
        help="API server processes sharing the port, each talking to every engine (default 1)",
    )
    parallel.add_argument(
        "--data-parallel-backend", choices=["mp", "ray"], default="mp",
        help="how engines start: mp (processes on this host, default) or ray (actors placed by Ray on "
        "the cluster at RAY_ADDRESS, one placement-group bundle each; engines on other nodes are "
        "reached over ZeroMQ/TCP); needs pip install 'ringllm[ray]'",
    )
    parallel.add_argument(
        "--data-parallel-size-local", "-dpl", type=_positive_int, metavar="N",
        help="engines on this host (default: all of them); the head waits for the others to "
        "register from --headless hosts",
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


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {number}")
    return number


def _engine_cpu(value: str) -> str:
    if value in ("auto", "off") or value.isdigit():
        return value
    raise argparse.ArgumentTypeError(f"expected auto, off or a core number, got {value!r}")


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
    given = {name: getattr(args, name) for name in _ENGINE_FIELDS if getattr(args, name, None) is not None}
    if getattr(args, "disable_log_stats", False):
        given["log_stats"] = False
    if getattr(args, "structured_outputs_max_whitespace", None) is not None:
        bound = args.structured_outputs_max_whitespace
        given["structured_outputs_max_whitespace"] = None if bound == UNBOUNDED_WHITESPACE else bound
    model = args.model
    if model is None:
        from core.models.default_model import default_model_dir

        model = default_model_dir()
    return EngineArgs(model=model, served_model_name=served_model_names(args)[0], **given)


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
