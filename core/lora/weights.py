"""An adapter's weights in the form the runner multiplies: one shrink and one expand per fused product.

Our layers fuse q/k/v into one product and gate/up into another
(core/models/llama.py), so an adapter's matrices are fused the same way: the
A matrices of the parts it targets are stacked into one shrink ``a_t``
[in, R] (one product reads the activations once for all parts), and each
part's B, scaled, expands its ranks of the shrink's output into that part's
columns of the fused output. Expanding part by part, rather than through one
block-diagonal matrix, reads no zeros: B is most of an adapter's bytes, and a
decode step is bound by the bytes it reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors import safe_open

from core.lora.adapter_spec import AdapterSpec, module_shape
from core.model_config import ModelConfig

# Hugging Face projection -> (our fused product, its place among the product's parts).
FUSED_PARTS = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
_PARTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}


@dataclass(frozen=True)
class LoRAPart:
    """One adapted part of a fused product: its ranks' columns of the shrink's output, and the
    product's output columns it expands into."""

    ranks: slice
    columns: slice
    b_t: torch.Tensor  # [r, columns], scaling applied
    b_np: np.ndarray | None = field(default=None, repr=False)  # the same, as numpy, on a CPU


@dataclass(frozen=True)
class LoRAProduct:
    """One fused product's adapter: ``s = x @ a_t``, then ``out[:, part.columns] += s[:, part.ranks] @ part.b_t``."""

    a_t: torch.Tensor  # [in, R]: the A matrices of every adapted part, stacked
    parts: tuple[LoRAPart, ...]
    a_np: np.ndarray | None = field(default=None, repr=False)  # a_t as numpy on a CPU (what its products use)


def _numpy(t: torch.Tensor) -> np.ndarray | None:
    return t.numpy() if t.device.type == "cpu" and t.dtype == torch.float32 else None


@dataclass(frozen=True)
class LoRAWeights:
    """A loaded adapter: its products by (layer, fused product name)."""

    lora_int_id: int
    name: str
    rank: int
    products: dict[tuple[int, str], LoRAProduct]

    @property
    def nbytes(self) -> int:
        return sum(p.a_t.nbytes + sum(part.b_t.nbytes for part in p.parts) for p in self.products.values())


def load_lora_weights(
    spec: AdapterSpec, cfg: ModelConfig, lora_int_id: int, name: str, dtype: torch.dtype, device: torch.device
) -> LoRAWeights:
    """Read the checked adapter ``spec``'s tensors and fuse them (in float32, then cast)."""
    by_product: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    with safe_open(spec.weights_file, framework="pt") as f:
        for (layer, module), (a_name, b_name) in spec.tensors.items():
            product, _ = FUSED_PARTS[module]
            a, b = f.get_tensor(a_name).float(), f.get_tensor(b_name).float()
            by_product.setdefault((layer, product), {})[module] = (a, b * spec.scaling)
    products = {}
    for (layer, product), parts in by_product.items():
        modules = [m for m in _PARTS[product] if m in parts]
        a_t = torch.cat([parts[m][0] for m in modules]).t().to(device, dtype).contiguous()  # [in, R]
        widths = [module_shape(cfg, m)[1] for m in _PARTS[product]]
        expands, rank = [], 0
        for m in modules:
            b = parts[m][1]  # [out, r]
            column = sum(widths[: _PARTS[product].index(m)])
            b_t = b.t().to(device, dtype).contiguous()
            expands.append(LoRAPart(slice(rank, rank + b.shape[1]), slice(column, column + b.shape[0]), b_t,
                                    _numpy(b_t)))
            rank += b.shape[1]
        products[(layer, product)] = LoRAProduct(a_t, tuple(expands), _numpy(a_t))
    return LoRAWeights(lora_int_id, name, spec.rank, products)
