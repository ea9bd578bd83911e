"""Command-line arguments of ``python -m app``, named as in ``vllm serve``.

Engine options left unset keep EngineConfig's defaults, so the defaults live
in one place. The server binds 127.0.0.1 unless --host says otherwise
(vLLM binds every interface): exposing an unauthenticated model server to the
network should be a decision, not a default.
"""

from __future__ import annotations

import argparse
import os
import re

from core.config import EngineConfig

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
}
_DTYPE_ALIASES = {
    "half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16",
}

# EngineConfig fields that map one to one onto an option of the same name.
_ENGINE_FIELDS = (
    "served_model_name", "tokenizer", "dtype", "device", "load_format", "seed", "max_model_len",
    "block_size", "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
    "enable_prefix_caching", "num_gpu_blocks_override", "kv_cache_memory",
    "gpu_memory_utilization", "enforce_eager", "transport", "scheduling_policy", "enable_prompt_embeds",
    "async_scheduling",
)


def parse_size(text: str) -> int:
    """Bytes from '268435456', '256MiB', '1.5G' (decimal k/M/G, binary KiB/MiB/GiB)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 536870912, 512MiB, 2G)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def _dtype(text: str) -> str:
    return _DTYPE_ALIASES.get(text, text)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m app",
        description="ringllm: an OpenAI-compatible LLM server (vLLM V1's engine over shared-memory rings).",
    )
    p.add_argument("--model", help="local Hugging Face model directory (default: the embedded demo model)")
    p.add_argument("--served-model-name", help="model name clients use in requests (default: --model)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    p.add_argument("--chat-template", help="chat template: a file path or the Jinja text itself")

    server = p.add_argument_group("server")
    server.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})")
    server.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free port)"
    )
    server.add_argument(
        "--api-key",
        default=os.environ.get("RINGLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $RINGLLM_API_KEY, else no auth)",
    )
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    engine = p.add_argument_group("engine")
    engine.add_argument("--dtype", type=_dtype, choices=["auto", "float32", "float16", "bfloat16"])
    engine.add_argument("--device", choices=["auto", "cpu", "cuda"])
    engine.add_argument("--load-format", choices=["auto", "safetensors", "dummy"])
    engine.add_argument("--seed", type=int)
    engine.add_argument("--max-model-len", type=int, help="context length (default: from config.json)")
    engine.add_argument("--max-num-seqs", type=int, help="most requests running at once")
    engine.add_argument("--max-num-batched-tokens", type=int, help="token budget of one engine step")
    engine.add_argument("--block-size", type=int, help="tokens per KV cache block")
    engine.add_argument("--num-gpu-blocks-override", type=int, help="KV cache blocks, whatever the memory")
    engine.add_argument("--kv-cache-memory", type=parse_size, help="bytes for the KV cache (e.g. 512MiB)")
    engine.add_argument("--gpu-memory-utilization", type=float)
    engine.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV cache of shared prompt prefixes (default on)",
    )
    engine.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    engine.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    engine.add_argument("--transport", choices=["shm", "zmq"], help="frontend-engine transport (default shm)")
    engine.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        help="waiting-queue order and preemption victim: arrival (default) or the request's priority",
    )
    engine.add_argument(
        "--async-scheduling",
        action="store_true",
        default=None,
        help="schedule the next batch while the model runs the current one",
    )
    engine.add_argument(
        "--enable-prompt-embeds", action="store_true", default=None,
        help="accept prompt_embeds (base64 torch.save tensors) in /v1/completions",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return make_parser().parse_args(argv)


def build_engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the parsed options (the default model is created if needed)."""
    given = {name: getattr(args, name) for name in _ENGINE_FIELDS if getattr(args, name, None) is not None}
    model = args.model
    if model is None:
        from core.models.default_model import (  # builds files on first use
            SERVED_NAME,
            ensure_default_model,
        )

        model = ensure_default_model()
        given.setdefault("served_model_name", SERVED_NAME)
    return EngineConfig(model=model, **given)


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
