"""The switches of the kernels: which paths they may take, and where built code is cached.

The kernels read no environment: an engine sets these from its own settings
(core/envs.py) when its model runner is built, and tests and benchmarks that
use the kernels directly change them here. Read at each use, or passed on to
loaded code by configure(), so a change takes effect at once.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


@dataclass
class KernelSettings:
    # The C kernels (kernels/cpu) where they apply; off: torch's (kernels/torch_ref.py).
    cpu_kernels: bool = True
    # "torch": the reference attention on every device (to bisect a GPU mismatch); "auto" otherwise.
    attention_backend: str = "auto"
    # Dense float32 products on a CPU through numpy's BLAS (kernels/linear.py); off: torch's.
    cpu_blas: bool = True
    # oneDNN packed copies of the weights for decode batches, where they were faster.
    cpu_prepack: bool = True
    # One-row float32 products through kernels/cpu's dense_few_rows too, not numpy's BLAS: set by
    # an engine for models whose weights are not all small, so that a lone decode runs as one call
    # of the C step program, one thread pool serves steps of one row and of a few (speculative
    # verification), and a row's product has the same bits however many rows share the step.
    few_rows_for_one: bool = False
    # Prefill chunks of at most this many (query, key) pairs are attended by the C kernels, longer
    # ones by torch's SDPA. No limit by default: on long prompts of real shapes the C kernels beat
    # SDPA too (bench/README.md); a limit is for comparing the two.
    prefill_pairs: int = sys.maxsize
    # Products with quantized weights (kernels/quant.py) quantize their activations to int8 per
    # block, as llama.cpp does; off (tests only), activations stay float32 and the weights are
    # expanded instead, so a product equals the float32 one of the dequantized weights.
    quantize_activations: bool = True
    # Whether a lone row's product with quantized weights also prefetches them by software: None
    # decides by the CPU (kernels/cpu.lone_row_prefetch); True or False to compare the two.
    lone_row_prefetch: bool | None = None
    # Where compiled kernels are kept (a "kernels" folder is made in it).
    cache_dir: Path = Path.home() / ".cache" / "ringllm"


settings = KernelSettings()
# Called after each configure(): for settings held by loaded code rather than read at each use.
_listeners: list[Callable[[KernelSettings], None]] = []


def on_change(listener: Callable[[KernelSettings], None]) -> None:
    """Have ``listener`` called with the settings after every configure()."""
    _listeners.append(listener)


def configure(**changes: Any) -> None:
    """Change some settings (unknown names raise TypeError)."""
    known = {f.name for f in fields(KernelSettings)}
    for name, value in changes.items():
        if name not in known:
            raise TypeError(f"no kernel setting {name!r}")
        setattr(settings, name, value)
    for listener in _listeners:
        listener(settings)
