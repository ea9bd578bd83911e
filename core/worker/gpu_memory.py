"""How much GPU memory the KV cache may take, measured the way vLLM does.

``--gpu-memory-utilization`` is the share of the GPU's *total* memory this
engine may end up using: weights, the CUDA context, activations of the
largest step, and the KV cache. Weights and context are already allocated
when the cache is sized (``total - free`` from ``cudaMemGetInfo``, which
also counts other processes on the GPU, so they are never overcommitted);
the activation peak is measured by running the largest step the scheduler
can send on dummy inputs; the KV cache gets what is left.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def kv_cache_budget(total: int, free: int, activation_peak: int, utilization: float) -> int:
    """Bytes left for the KV cache (may be negative when nothing is left)."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    return int(total * utilization) - (total - free) - activation_peak


def measure_activation_peak(device: torch.device, run: Callable[[], None]) -> int:
    """Peak bytes ``run`` allocates on ``device`` beyond what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - baseline
    torch.cuda.empty_cache()  # hand the activations back, so mem_get_info sees them free
    return peak


def gpu_kv_cache_budget(device: torch.device, utilization: float, profile_run: Callable[[], None]) -> int:
    """The KV cache budget after profiling ``profile_run`` (the largest step)."""
    activation_peak = measure_activation_peak(device, profile_run)
    free, total = torch.cuda.mem_get_info(device)
    return kv_cache_budget(total, free, activation_peak, utilization)
