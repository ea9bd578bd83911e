"""Building blocks of the decoder models, shaped for the cost of a step on a CPU.

A small model's decode step is mostly fixed per-call costs, so these blocks
make few calls: modules are called without ``nn.Module``'s hook machinery
(the engine registers no hooks), and the work between the matrix products is
done by the fused kernels of ``kernels`` (norms with the residual add, q and k
rotated together in place from position tables).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels.linear import CpuWeight, DenseRows, linear
from kernels.lora import LoRASlot
from kernels.quant import QuantizedMatrix, QuantizedWeight


class Module(nn.Module):
    """An ``nn.Module`` whose call is just ``forward``: no hooks, no per-call bookkeeping."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)


class Linear(nn.Linear):
    """``nn.Linear`` that sends small CPU float32 batches to numpy's BLAS (kernels/linear.py),
    or multiplies weights kept in GGUF block formats (kernels/quant.py).

    ``prepare()`` (after the weights are loaded) makes the numpy views of the
    weight; until then, or where they do not apply, torch computes.
    """

    cpu_weight: CpuWeight | QuantizedWeight | None = None  # what the CPU products multiply
    quantized: QuantizedWeight | None = None  # block-format weights: the float weight is then empty
    # With --enable-lora: the product's LoRA deltas, added to its output (kernels/lora.py).
    adapters: LoRASlot | None = None

    def reset_parameters(self) -> None:
        """No random initialisation: the weights are always loaded (or filled by the dummy loader)."""

    def set_quantized(self, parts: list[QuantizedMatrix]) -> None:
        """Serve this layer from block-format weights (its rows, part by part); the float
        weight is dropped (the bias stays, and is added by the products)."""
        bias = None if self.bias is None else self.bias.detach().numpy()
        self.quantized = QuantizedWeight(parts, bias)
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def prepare(self) -> None:
        if self.quantized is not None:
            if self.bias is not None:  # the bias may have been loaded after the weight
                self.quantized = QuantizedWeight(self.quantized.parts, self.bias.detach().numpy())
            self.cpu_weight = self.quantized
            return
        self.cpu_weight = CpuWeight(self.weight, self.bias) if CpuWeight.usable(self.weight) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.cpu_weight)
        if self.adapters is not None:
            self.adapters.add(x, y)
        return y

    __call__ = forward


def gated_activation(kind: str, gate_up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` of [gate | up] rows (``kind``: silu, gelu_pytorch_tanh or gelu)."""
    if kind == "silu":
        return kernels.silu_mul(gate_up)
    if kind == "gelu_pytorch_tanh":
        return kernels.gelu_tanh_mul(gate_up)
    size = gate_up.shape[1] // 2
    return F.gelu(gate_up[:, :size]) * gate_up[:, size:]


class GatedMLPWeights(Module):
    """A gated MLP's weights: fused gate/up, and down (a layer's MLP, Qwen2-MoE's shared expert)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)


class Embedding(nn.Embedding):
    """Token embeddings: a float table, or one kept in a GGUF block format (its rows expanded
    as they are looked up)."""

    quantized: QuantizedMatrix | None = None

    def set_quantized(self, matrix: QuantizedMatrix) -> None:
        self.quantized = matrix
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def table(self) -> DenseRows | QuantizedMatrix:
        """What the CPU step program looks rows up in (``take_rows(ids, out)``)."""
        return self.quantized if self.quantized is not None else DenseRows(self.weight.detach().numpy())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return torch.from_numpy(self.quantized.take_rows(ids.numpy()))
        return F.embedding(ids, self.weight)

    __call__ = forward


class RMSNorm(Module):
    """Normalise in float32, scale in the model dtype (the Hugging Face formula)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        """``norm(x)``; with ``residual``: ``residual += x`` in place and ``(norm(residual), residual)``."""
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (float32, CPU), with linear or llama3 scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        # Long wavelengths are slowed down by `factor`, short ones kept, and the
        # band between is interpolated smoothly (Llama 3.1's context extension).
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(
        f"unsupported rope scaling type {rope_type!r}; supported: default, linear, llama3"
    )


class RotaryEmbedding:
    """Rotary position embedding in the "half split" convention of Hugging Face checkpoints.

    The cos and sin± rows (sin with its first half negated, see
    ``kernels.torch_ref.rotary``) of every position up to ``max_positions``
    are tabulated per device and dtype on first use, computed in float32 as
    the reference does, then cast.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int) -> None:
        self.head_dim = head_dim
        self.max_positions = max_positions
        self._inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin±) tables [max_positions, head_dim]."""
        table = self._tables.get((device, dtype))
        if table is None:
            freqs = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * self._inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
            half = self.head_dim // 2
            sin[:, :half].neg_()
            table = self._tables[(device, dtype)] = (cos.to(device), sin.to(device))
        return table
