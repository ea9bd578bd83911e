"""LoRA deltas of a mixed batch: rows grouped by adapter, a shrink and an expand per group.

A step's rows may belong to the base model and to several adapters at once
(punica's segmented gather: SGMV). Each adapted product of the model has, per
adapter, a shrink ``a_t`` [in, R] and an expand ``b_t`` [R, out]
(core/lora/weights.py); the step's ``LoRABatch`` lists, per adapter present,
its products and its token rows. After the base product ``y = x W``, every
group adds ``(x[rows] @ a_t) @ b_t`` to ``y[rows]``: two small products over
that adapter's rows only. Rows of the base model are in no group, and a step
without adapters has no groups: its products pay one empty loop each.

On a CPU the products go through numpy's BLAS on the arrays the layers
already use (the forward pass's tensors share their memory), so the forward
pass and the CPU step program (core/worker/cpu_program.py) add the same bits.
Elsewhere torch's ``addmm``/``index_add_`` do it on the device. Rows are a
slice when the group's rows are contiguous (one request's chunk, a decode
batch whose adapter rows are neighbours), else an index array.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

Rows = slice | np.ndarray


@dataclass(frozen=True)
class LoRAGroup:
    """One adapter's rows of a step: its products by (layer, product name), and the rows."""

    products: dict[tuple[int, str], Any]  # -> core.lora.weights.LoRAProduct
    rows: Rows
    rows_t: torch.Tensor | None  # ``rows`` as a device index tensor (torch path, non-contiguous rows)


class LoRABatch:
    """The adapter groups of the step being run, shared by every adapted product of a model
    (the runner sets them before each step)."""

    __slots__ = ("groups",)

    def __init__(self) -> None:
        self.groups: list[LoRAGroup] = []


class LoRASlot:
    """An adapted product of the model: which one it is, and the batch it reads its groups from."""

    __slots__ = ("batch", "key")

    def __init__(self, batch: LoRABatch, key: tuple[int, str]) -> None:
        self.batch = batch
        self.key = key

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y[rows] += (x[rows] @ a_t) @ b_t`` for every group whose adapter adapts this product."""
        if not self.batch.groups:
            return
        if x.device.type == "cpu" and x.dtype == torch.float32 and y.is_contiguous():
            self.add_numpy(x.contiguous().numpy(), y.numpy())
            return
        for group in self.batch.groups:
            product = group.products.get(self.key)
            if product is None:
                continue
            rows = group.rows
            if isinstance(rows, slice):
                y[rows].addmm_(x[rows] @ product.a_t, product.b_t)
            else:
                y.index_add_(0, group.rows_t, (x[group.rows_t] @ product.a_t) @ product.b_t)

    def add_numpy(self, x: np.ndarray, y: np.ndarray) -> None:
        """The CPU path on float32 arrays (the step program calls it directly)."""
        for group in self.batch.groups:
            product = group.products.get(self.key)
            if product is None:
                continue
            rows = group.rows
            y[rows] += (x[rows] @ product.a_np) @ product.b_np


def group_rows(token_rows: np.ndarray) -> Rows:
    """``token_rows`` (sorted) as a slice when they are contiguous, else as they are."""
    first, last = int(token_rows[0]), int(token_rows[-1])
    if last - first + 1 == token_rows.size:
        return slice(first, last + 1)
    return token_rows
