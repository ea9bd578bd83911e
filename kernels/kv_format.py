"""How a paged KV cache stores one head's keys or values of one token.

A cache tensor is ``[blocks, block_size, kv_heads, row]``; what a row holds depends on the
tensor's dtype (its storage):

- float32 or a compute dtype: the ``head_dim`` values as they are;
- float16 under float32 compute on a CPU: the values rounded to half, widened as they are read;
- uint8, the ``q8_0`` format of llama.cpp's ``-ctk/-ctv q8_0``: each run of 32 values is a block
  of a float16 scale and 32 int8 (34 bytes; 1.0625 bytes a value against 2 for float16), quantized
  when the step's keys and values are written and read back by the attention kernels directly.

Quantization follows llama.cpp's reference (``quantize_row_q8_0_ref``): scale = max|x| / 127, each
value multiplied by 1/scale and rounded half away from zero, the scale stored as float16. The
functions here are the torch reference of the C kernels (kernels/cpu/cpu_kernels.c), which give the
same bits.
"""

from __future__ import annotations

from enum import IntEnum

import torch

Q8_0_VALUES = 32  # values per block
Q8_0_BYTES = 34  # a float16 scale, then 32 int8


class KVFormat(IntEnum):
    """The C kernels' ``kv_format`` codes."""

    FLOAT32 = 0
    FLOAT16 = 1
    Q8_0 = 2

    @classmethod
    def of(cls, cache: torch.Tensor) -> KVFormat:
        return {torch.float32: cls.FLOAT32, torch.float16: cls.FLOAT16, torch.uint8: cls.Q8_0}[cache.dtype]


def is_quantized(storage: torch.dtype) -> bool:
    return storage == torch.uint8


def storage_name(storage: torch.dtype) -> str:
    """The ``--kv-cache-dtype`` that names ``storage``."""
    return "q8_0" if is_quantized(storage) else str(storage).removeprefix("torch.")


def row_width(storage: torch.dtype, head_dim: int) -> int:
    """Elements of ``storage`` in one head's row of the cache."""
    if not is_quantized(storage):
        return head_dim
    if head_dim % Q8_0_VALUES:
        raise ValueError(f"a q8_0 KV cache stores blocks of {Q8_0_VALUES} values: head_dim {head_dim} is not "
                         "a multiple")
    return head_dim // Q8_0_VALUES * Q8_0_BYTES


def head_dim_of(cache: torch.Tensor) -> int:
    """The head size a cache tensor ``[..., row]`` holds."""
    width = cache.shape[-1]
    return width // Q8_0_BYTES * Q8_0_VALUES if is_quantized(cache.dtype) else width


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """float32 rows ``[..., D]`` (D a multiple of 32) as q8_0 bytes ``[..., D / 32 * 34]``."""
    blocks = x.float().reshape(*x.shape[:-1], -1, Q8_0_VALUES)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    scaled = blocks * inverse
    # C's roundf: halves away from zero (torch.round sends them to the even neighbour).
    whole = torch.trunc(scaled)
    rounded = torch.where((scaled - whole).abs() == 0.5, whole + torch.sign(scaled), torch.round(scaled))
    quants = rounded.to(torch.int8).view(torch.uint8)
    scales = scale.to(torch.float16).view(torch.uint8)  # [..., blocks, 2] in the machine's byte order
    return torch.cat([scales, quants], dim=-1).reshape(*x.shape[:-1], -1)


def dequantize_q8_0(rows: torch.Tensor) -> torch.Tensor:
    """q8_0 bytes ``[..., W]`` back to float32 ``[..., W / 34 * 32]``."""
    blocks = rows.reshape(*rows.shape[:-1], -1, Q8_0_BYTES)
    scale = blocks[..., :2].contiguous().view(torch.float16).float()
    quants = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (scale * quants).reshape(*rows.shape[:-1], -1)


def to_storage(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """Rows of keys or values ``[..., D]`` as the cache stores them."""
    return quantize_q8_0(x) if is_quantized(storage) else x.to(storage)


def from_storage(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached rows ``[..., row]`` as values ``[..., D]`` in ``dtype``."""
    return dequantize_q8_0(rows).to(dtype) if is_quantized(rows.dtype) else rows.to(dtype)
