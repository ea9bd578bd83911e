"""Dense layers ``y = x Wᵀ + b``: numpy's BLAS for small CPU batches, torch otherwise.

A decode step multiplies a few rows by every weight matrix once, so it runs
at the speed weights stream from memory. torch's CPU build does this in MKL,
whose dispatch on AMD processors falls back to a generic kernel that reaches
about half the memory bandwidth that the OpenBLAS bundled with numpy does on
the same tensors; for larger batches (prefill chunks) OpenBLAS was as fast or
faster here too (bench/README.md has the figures). float32 CPU products
therefore go through numpy on zero-copy views of the same memory (set
``RINGLLM_CPU_BLAS=0`` to keep torch's); other dtypes and devices keep
torch's kernels. numpy releases the GIL inside BLAS, so the engine's I/O
threads run meanwhile.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

CPU_BLAS = os.environ.get("RINGLLM_CPU_BLAS", "1") != "0"


class CpuWeight:
    """numpy views of a CPU float32 weight (and bias), made once after loading."""

    __slots__ = ("weight_t", "bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight_t = weight.detach().numpy().T  # [in, out], a transposed view: BLAS reads it as is
        self.bias = None if bias is None else bias.detach().numpy()

    @staticmethod
    def usable(weight: torch.Tensor) -> bool:
        return CPU_BLAS and weight.device.type == "cpu" and weight.dtype == torch.float32


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, cpu: CpuWeight | None = None
) -> torch.Tensor:
    """``x [N, in] @ weight[out, in]ᵀ + bias``; ``cpu`` (the weight's numpy views)
    sends the product to numpy's BLAS."""
    if cpu is not None and x.dtype == torch.float32:
        out = np.matmul(x.numpy(), cpu.weight_t)
        if cpu.bias is not None:
            out += cpu.bias
        return torch.from_numpy(out)
    return F.linear(x, weight, bias)
