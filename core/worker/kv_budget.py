"""How many KV cache blocks each group gets, and the memory behind them.

The budget is ``kv_cache_memory`` bytes when given. Otherwise, on a CPU it is
``default_cpu_kv_budget()`` (or one full-length request, if more); on a GPU what
``gpu_memory_utilization`` leaves after the weights and the profiled peak of the
largest step (core/worker/gpu_memory.py); either is capped at what ``max_num_seqs``
full-length requests could ever use. Data-parallel engines on one host take one share
each. Every KV cache group draws from the one pool (core/kv/kv_groups.py).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable

import torch

from core.config import CPU_KV_CACHE_MEMORY, CPU_KV_CACHE_MIN_MEMORY, EngineConfig
from core.kv.kv_groups import KVCacheGroups
from core.utils import cdiv
from core.worker.gpu_memory import gpu_kv_cache_budget


def default_cpu_kv_budget() -> int:
    """The CPU KV cache's default size: CPU_KV_CACHE_MEMORY (vLLM's CPU default), at most a
    quarter of the memory the system has available now (the weights are loaded by then, and
    the rest is left to other processes and the page cache), at least CPU_KV_CACHE_MIN_MEMORY."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):  # not Linux: the minimum
        return CPU_KV_CACHE_MIN_MEMORY
    return max(CPU_KV_CACHE_MIN_MEMORY, min(CPU_KV_CACHE_MEMORY, available // 4))


def mapped_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in an anonymous mapping of its own: the kernel's zero pages,
    made resident only as the KV cache fills (no memset of gigabytes at start-up, no memory
    held that no request uses), and unmapped whole when the tensor goes (sleep mode)."""
    count = math.prod(shape)
    return torch.frombuffer(mmap.mmap(-1, max(count * dtype.itemsize, 1)), dtype=dtype, count=count).view(shape)


def kv_cache_blocks(
    config: EngineConfig, groups: KVCacheGroups, bytes_per_block: int, device: torch.device, encoder: bool,
    profile_run: Callable[[], None],
) -> int:
    """Blocks of the KV cache's one pool: the override, else the memory budget (ValueError when
    it cannot hold one request of max_model_len). ``bytes_per_block``: one block in every cache
    tensor; ``profile_run`` measures a GPU's peak step."""
    cache, scheduler = config.cache_config, config.scheduler_config
    block_size, max_model_len = cache.block_size, config.max_model_len
    max_blocks_per_req = cdiv(max_model_len, block_size)
    most = groups.most_blocks(block_size, scheduler.max_num_seqs, scheduler.max_num_batched_tokens, max_blocks_per_req)
    least = groups.least_blocks(block_size, scheduler.max_num_batched_tokens, max_model_len) + 1
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    if encoder:  # blocks count the step's tokens only: no memory behind them
        return most
    share = config.parallel_config.engines_on_this_host  # data-parallel engines split the budget
    if cache.kv_cache_memory is not None:
        # Past what the running requests can hold, blocks only keep evicted prefixes: a
        # given budget is spent on them all the same.
        num_blocks = cache.kv_cache_memory // share // bytes_per_block
    else:
        if device.type == "cuda":
            budget = gpu_kv_cache_budget(device, cache.gpu_memory_utilization / share, profile_run)
        else:
            # Never less than one request of max_model_len: a model whose context is long (a
            # GGUF file's, 32k and more) serves out of the box, one full-length request at a time.
            budget = max(default_cpu_kv_budget() // share, least * bytes_per_block)
        num_blocks = min(max(budget, 0) // bytes_per_block, most)
    if num_blocks < least:
        raise ValueError(
            f"KV cache too small: {num_blocks} blocks of {block_size} tokens cannot hold "
            f"one request of max_model_len={max_model_len}; raise the memory budget or lower --max-model-len"
        )
    return num_blocks
