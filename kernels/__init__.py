"""The model's kernels, dispatched on the tensors' device and dtype.

- CUDA tensors: the Triton kernels (kernels/triton_attention.py) for the
  paged KV write and paged attention, torch for the rest. Triton is imported
  on first CUDA use only, so CPU processes never pay for it.
- float32 CPU tensors: the C kernels (kernels/cpu/), built on first use; decode
  attention reads the paged cache in place, prefill chunks use torch's SDPA.
- anything else, or where the C kernels cannot be built: torch
  (kernels/torch_ref.py), which is also the reference the others are tested
  against. ``settings.attention_backend = "torch"`` forces it for attention on
  every device (to bisect a GPU mismatch); ``settings.cpu_kernels = False`` keeps
  the C kernels off (kernels/settings.py; an engine sets them from
  ``RINGLLM_ATTENTION_BACKEND`` and ``RINGLLM_CPU_KERNELS``).

Dense products are in kernels/linear.py.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kernels import cpu, torch_ref
from kernels.metadata import AttentionMetadata
from kernels.settings import settings

__all__ = [
    "AttentionMetadata", "add_rms_norm", "gelu_tanh_mul", "paged_attention", "rms_norm", "rotary", "scale_rows",
    "silu_mul", "write_kv_cache",
]

_triton: ModuleType | None = None


def _attention_backend(tensor: torch.Tensor) -> ModuleType:
    global _triton
    if not tensor.is_cuda or settings.attention_backend == "torch":
        return torch_ref
    if _triton is None:
        from kernels import triton_attention

        _triton = triton_attention
    return _triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension (x [N, n], or [N, H, n] for per-head norms)."""
    if cpu.usable(x):
        return cpu.rms_norm(x, weight, eps)
    return torch_ref.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` (in place), then ``(rms_norm(residual), residual)``."""
    if cpu.usable(x, residual) and x.is_contiguous() and residual.is_contiguous():
        return cpu.add_rms_norm(x, residual, weight, eps)
    return torch_ref.add_rms_norm(x, residual, weight, eps)


def rotary(
    qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin_signed: torch.Tensor, positions: torch.Tensor
) -> None:
    """Rotate heads ``:heads`` of qkv [T, H, D] in place by the rotary tables' rows at ``positions``."""
    if cpu.usable(qkv) and qkv.stride(2) == 1 and qkv.stride(1) == qkv.shape[2] and qkv.shape[2] <= cpu.MAX_HEAD_DIM:
        cpu.rotary(qkv, heads, cos, sin_signed, positions)
    else:
        torch_ref.rotary(qkv, heads, cos, sin_signed, positions)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up rows [gate | up]."""
    if cpu.usable(gate_up) and gate_up.is_contiguous():
        return cpu.silu_mul(gate_up)
    return torch_ref.silu_mul(gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for gate_up rows [gate | up] (GeGLU)."""
    if cpu.usable(gate_up) and gate_up.is_contiguous():
        return cpu.gelu_tanh_mul(gate_up)
    return torch_ref.gelu_tanh_mul(gate_up)


def scale_rows(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x * factor (in place on the C path; factor rounded to x's dtype, as Gemma scales its embeddings)."""
    if cpu.usable(x) and x.is_contiguous():
        return cpu.scale_rows(x, factor)
    # A Python scalar, not a device tensor: nothing is copied to the device, so a CUDA graph can
    # capture it (the rounded factor is exact in the float32 the product is computed in).
    return x * float(torch.tensor(factor, dtype=x.dtype))


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
    backend = _attention_backend(key)
    if backend is not torch_ref:
        backend.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    elif cpu.usable(key, value, cache=k_cache) and _heads_contiguous(key) and _heads_contiguous(value):
        cpu.write_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        torch_ref.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, may_pad)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """query [T, Hq, D] attends causally over each request's paged context -> [T, Hq, D];
    with a sliding ``window`` > 0 each query sees the last ``window`` positions up to its own."""
    backend = _attention_backend(query)
    if backend is not torch_ref or not (cpu.usable(query, cache=k_cache) and _heads_contiguous(query)):
        return backend.paged_attention(query, k_cache, v_cache, meta, scale, out, window)
    whole_chunks = query.shape[2] in cpu.PREFILL_KERNEL_HEAD_DIMS
    step = torch_ref.plan(meta, k_cache.shape[1], query.device, settings.prefill_pairs, whole_chunks, window)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype)
    if step.query_rows is not None:
        cpu.paged_decode_attention(
            query, k_cache, v_cache, meta.block_tables, step.query_rows, step.query_tables,
            step.query_seq_lens, step.query_max_len, scale, out, window,
        )
    for start, end, r, seq_len in step.small_prefills:
        cpu.paged_prefill_attention(
            query[start:end], k_cache, v_cache, meta.block_tables[r], seq_len, scale, out[start:end], window
        )
    torch_ref.attend_prefills(query, k_cache, v_cache, step, scale, out)
    return out


def _heads_contiguous(x: torch.Tensor) -> bool:
    """[T, H, D] with each token's heads back to back (a token's row may be strided)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]
