"""Every ``RINGLLM_*`` environment variable: read here and nowhere else (vLLM's envs.py pattern).

Each is read when asked for (``envs.RINGLLM_CACHE``), never at import time,
so a test's ``monkeypatch.setenv`` or a parent's environment for a spawned
engine takes effect. Command-line flags are the way to configure a server;
these are for what a flag would not suit: tuning and debugging switches of
the kernels, test-only fault injection, and two defaults that deployments
set from their environment (the API key, the stats interval). docs/operations.md
lists them from ``ENV_VARS``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _flag(text: str) -> bool:
    return text != "0"


def _flag_or_auto(text: str) -> bool | None:
    return None if text == "auto" else _flag(text)


@dataclass(frozen=True)
class EnvVar:
    name: str
    parse: Callable[[str], Any]
    default: Any  # when unset (or set to the empty string)
    doc: str


ENV_VARS: dict[str, EnvVar] = {
    var.name: var
    for var in (
        EnvVar("RINGLLM_API_KEY", str, None,
               "Default of --api-key: require 'Authorization: Bearer KEY' on the API."),
        EnvVar("RINGLLM_LOG_STATS_INTERVAL", float, 10.0,
               "Seconds between the periodic stats lines of the frontend."),
        EnvVar("RINGLLM_CACHE", Path, Path.home() / ".cache" / "ringllm",
               "Where compiled CPU kernels and the random-weights test model are kept."),
        EnvVar("RINGLLM_CPU_KERNELS", _flag, True,
               "0: the engine uses torch's kernels instead of the C ones (kernels/cpu) on a CPU."),
        EnvVar("RINGLLM_CPU_BLAS", _flag, True,
               "0: dense products through torch rather than numpy's BLAS (and no CPU step program)."),
        EnvVar("RINGLLM_CPU_PREPACK", _flag, True,
               "0: no oneDNN packed copies of the weights for decode batches (saves their memory)."),
        EnvVar("RINGLLM_CPU_PREFILL_PAIRS", int, sys.maxsize,
               "Prefill chunks of at most this many (query, key) pairs are attended by the C kernels, longer "
               "ones by torch's SDPA (default: no limit)."),
        EnvVar("RINGLLM_LONE_ROW_PREFETCH", _flag_or_auto, None,
               "1 or 0: a lone decode row's quantized weights are (not) also prefetched by software; "
               "auto (the default): on where the CPU lacks AVX-512 (bench/README.md measures both)."),
        EnvVar("RINGLLM_ATTENTION_BACKEND", str, "auto",
               "torch: the reference attention on every device (to bisect a GPU mismatch)."),
        EnvVar("RINGLLM_SPEC_DECODE_GATE", _flag, True,
               "0: speculative decoding drafts whenever it can, even where it measures slower."),
        EnvVar("RINGLLM_FAULT_INJECT", str, None,
               "Tests only: step:N makes the engine's N-th model step raise (core/worker/faults.py)."),
    )
}


def get(name: str) -> Any:
    """The variable's value now, parsed; its default when unset (KeyError for an unknown name)."""
    var = ENV_VARS[name]
    text = os.environ.get(name)
    if not text:
        return var.default
    try:
        return var.parse(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not valid: {var.doc}") from None


def __getattr__(name: str) -> Any:
    if name in ENV_VARS:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def kernel_settings() -> dict[str, Any]:
    """The kernels' settings (kernels/settings.py) as this environment asks, for an engine."""
    return {
        "cpu_kernels": get("RINGLLM_CPU_KERNELS"),
        "attention_backend": get("RINGLLM_ATTENTION_BACKEND"),
        "cpu_blas": get("RINGLLM_CPU_BLAS"),
        "cpu_prepack": get("RINGLLM_CPU_PREPACK"),
        "prefill_pairs": get("RINGLLM_CPU_PREFILL_PAIRS"),
        "lone_row_prefetch": get("RINGLLM_LONE_ROW_PREFETCH"),
        "cache_dir": get("RINGLLM_CACHE"),
    }
