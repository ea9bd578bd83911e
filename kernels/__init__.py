"""Attention and cache kernels, dispatched on the tensors' device.

CUDA tensors go to the Triton kernels (kernels/triton_attention.py), CPU
tensors to the torch reference (kernels/torch_ref.py). Triton is imported on
first CUDA use only, so CPU processes never pay for it. Setting
``RINGLLM_ATTENTION_BACKEND=torch`` forces the torch path everywhere (useful
to bisect a GPU mismatch).
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from kernels import torch_ref
from kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "paged_attention", "write_kv_cache"]

_triton: ModuleType | None = None


def _backend(tensor: torch.Tensor) -> ModuleType:
    global _triton
    if not tensor.is_cuda or os.environ.get("RINGLLM_ATTENTION_BACKEND") == "torch":
        return torch_ref
    if _triton is None:
        from kernels import triton_attention

        _triton = triton_attention
    return _triton


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    may_pad: bool = True,
) -> None:
    """Store this step's key/value [T, Hkv, D] at ``slot_mapping`` in the paged caches;
    negative slots (padding) are skipped. ``may_pad=False`` promises there are none."""
    backend = _backend(key)
    if backend is torch_ref:
        torch_ref.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, may_pad)
    else:
        backend.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [T, Hq, D] attends causally over each request's paged context -> [T, Hq, D]."""
    return _backend(query).paged_attention(query, k_cache, v_cache, meta, scale, out)
