"""LoRA deltas of a mixed batch: rows grouped by adapter, a shrink and an expand per group.

A step's rows may belong to the base model and to several adapters at once
(punica's segmented gather: SGMV). Each adapted product of the model has, per
adapter, a shrink ``a_t`` [in, R] and an expand per adapted part
(core/lora/weights.py); the step's ``LoRABatch`` lists, per adapter present,
its products and its token rows. After the base product ``y = x W``, every
group shrinks its rows once, ``s = x[rows] @ a_t``, and each part adds
``s[:, ranks] @ b_t`` to its columns of ``y[rows]``: small products over that
adapter's rows only. Rows of the base model are in no group, and a step
without adapters has no groups: its products pay one empty loop each.

On a CPU the products go through numpy's BLAS on the arrays the layers
already use (the forward pass's tensors share their memory), so the forward
pass and the CPU step program (core/worker/cpu_program.py) add the same bits.
Elsewhere torch's ``addmm``/``index_add_`` do it on the device. Rows are a
slice when the group's rows are contiguous (the scheduler orders a step's
requests by adapter for that), else an index array.
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
        """For every group whose adapter adapts this product, its rows' delta added to ``y``."""
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
                shrunk = x[rows] @ product.a_t
                for part in product.parts:
                    y[rows, part.columns].addmm_(shrunk[:, part.ranks], part.b_t)
            else:
                shrunk = x[group.rows_t] @ product.a_t
                for part in product.parts:
                    y[:, part.columns].index_add_(0, group.rows_t, shrunk[:, part.ranks] @ part.b_t)

    def add_numpy(self, x: np.ndarray, y: np.ndarray) -> None:
        """The CPU path on float32 arrays (the step program calls it directly)."""
        for group in self.batch.groups:
            product = group.products.get(self.key)
            if product is None:
                continue
            rows = group.rows
            shrunk = x[rows] @ product.a_np
            for part in product.parts:
                y[rows, part.columns] += shrunk[:, part.ranks] @ part.b_np


def group_rows(token_rows: np.ndarray) -> Rows:
    """``token_rows`` (sorted) as a slice when they are contiguous, else as they are."""
    first, last = int(token_rows[0]), int(token_rows[-1])
    if last - first + 1 == token_rows.size:
        return slice(first, last + 1)
    return token_rows
