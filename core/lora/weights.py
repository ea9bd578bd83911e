"""An adapter's weights in the form the runner multiplies: one shrink and one expand per fused product.

Our layers fuse q/k/v into one product and gate/up into another
(core/models/llama.py), so an adapter's matrices are fused the same way: the
A matrices of the parts it targets are stacked into one shrink ``a_t``
[in, R], and their B matrices, scaled, placed block-diagonally into one
expand ``b_t`` [R, out] whose columns are the fused product's (zero where
a part is not targeted). A product's delta for rows ``x`` is then
``(x @ a_t) @ b_t``: two small products, whatever the number of parts.
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
class LoRAProduct:
    """One fused product's adapter: ``out += (x @ a_t) @ b_t``."""

    a_t: torch.Tensor  # [in, R]
    b_t: torch.Tensor  # [R, out], scaling applied
    # The same tensors as numpy arrays on a CPU (what the CPU products multiply), else None.
    a_np: np.ndarray | None = field(default=None, repr=False)
    b_np: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def of(cls, a_t: torch.Tensor, b_t: torch.Tensor) -> LoRAProduct:
        on_cpu = a_t.device.type == "cpu" and a_t.dtype == torch.float32
        return cls(a_t, b_t, a_t.numpy() if on_cpu else None, b_t.numpy() if on_cpu else None)


@dataclass(frozen=True)
class LoRAWeights:
    """A loaded adapter: its products by (layer, fused product name)."""

    lora_int_id: int
    name: str
    rank: int
    products: dict[tuple[int, str], LoRAProduct]

    @property
    def nbytes(self) -> int:
        return sum(p.a_t.nbytes + p.b_t.nbytes for p in self.products.values())


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
        a_t = torch.cat([parts[m][0] for m in modules]).t()  # [in, R]
        widths = [module_shape(cfg, m)[1] for m in _PARTS[product]]
        b_t = torch.zeros(a_t.shape[1], sum(widths))
        row = 0
        for m in modules:
            b = parts[m][1]  # [out, r]
            column = sum(widths[: _PARTS[product].index(m)])
            b_t[row : row + b.shape[1], column : column + b.shape[0]] = b.t()
            row += b.shape[1]
        products[(layer, product)] = LoRAProduct.of(
            a_t.to(device, dtype).contiguous(), b_t.to(device, dtype).contiguous()
        )
    return LoRAWeights(lora_int_id, name, spec.rank, products)
