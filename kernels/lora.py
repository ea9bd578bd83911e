"""LoRA deltas of a mixed batch: rows grouped by adapter, a shrink and an expand per group.

A step's rows may belong to the base model and to several adapters at once
(punica's segmented gather: SGMV). Each adapted product of the model has, per
adapter, a shrink ``a`` [R, in] and an expand per adapted part
(core/lora/weights.py); the step's ``LoRABatch`` lists, per adapter present,
its products and its token rows. After the base product ``y = x W``, every
group shrinks its rows once, ``s = x[rows] @ a.T``, and each part adds
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

from kernels import cpu
from kernels.settings import settings

Rows = slice | np.ndarray
# Groups of up to this many rows go through kernels/cpu's lora_rows (one call per product),
# larger ones through BLAS, whose per-call cost they repay.
FEW_ROWS = 16


@dataclass(frozen=True)
class LoRAGroup:
    """One adapter's rows of a step: its products by (layer, product name), and the rows."""

    products: dict[tuple[int, str], Any]  # -> core.lora.weights.LoRAProduct
    rows: Rows
    rows_t: torch.Tensor | None  # ``rows`` as a device index tensor (torch path, non-contiguous rows)

    @property
    def size(self) -> int:
        rows = self.rows
        return rows.stop - rows.start if isinstance(rows, slice) else rows.size

    @property
    def rows_address(self) -> int:
        """The address of the row indices (an index array, which the group keeps alive)."""
        assert isinstance(self.rows, np.ndarray)
        return self.rows.ctypes.data


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
                shrunk = x[rows] @ product.a.t()
                for part in product.parts:
                    y[rows, part.columns].addmm_(shrunk[:, part.ranks], part.b_t)
            else:
                shrunk = x[group.rows_t] @ product.a.t()
                for part in product.parts:
                    y[:, part.columns].index_add_(0, group.rows_t, shrunk[:, part.ranks] @ part.b_t)

    def add_numpy(self, x: np.ndarray, y: np.ndarray) -> None:
        """The CPU path on float32 arrays whose rows are contiguous (the step program calls it
        directly): a group of a few rows in one call of kernels/cpu's ``lora_rows``, a larger one
        (a prefill chunk) through numpy's BLAS."""
        lib = _few_rows_library()
        x_p = y_p = 0
        for group in self.batch.groups:
            product = group.products.get(self.key)
            if product is None:
                continue
            rows = group.rows
            if lib is not None and product.kernel_args and group.size <= FEW_ROWS:
                if not x_p:
                    x_p, y_p = x.ctypes.data, y.ctypes.data
                x_stride, y_stride = x.strides[0] // 4, y.strides[0] // 4
                a_p, desc_p, b_p, scratch_p = product.kernel_args
                if isinstance(rows, slice):
                    lib.lora_rows(x_p + rows.start * x_stride * 4, x_stride, None, group.size, a_p, x.shape[1],
                                  product.a_np.shape[0], desc_p, b_p, len(product.parts),
                                  y_p + rows.start * y_stride * 4, y_stride, scratch_p)
                else:
                    lib.lora_rows(x_p, x_stride, group.rows_address, group.size, a_p, x.shape[1],
                                  product.a_np.shape[0], desc_p, b_p, len(product.parts), y_p, y_stride, scratch_p)
                continue
            shrunk = x[rows] @ product.a_np.T
            for part in product.parts:
                y[rows, part.columns] += shrunk[:, part.ranks] @ part.b_np


def lora_kernel_scratch(ranks: int) -> np.ndarray | None:
    """The scratch kernels/cpu's lora_rows needs for a product of ``ranks`` ranks; None where
    the C kernels are off or not built (the products then go through BLAS)."""
    lib = _few_rows_library()
    return None if lib is None else np.zeros(lib.lora_scratch_floats(ranks), np.float32)


def _few_rows_library() -> Any:
    """kernels/cpu's library when the C kernels are on and built, else None."""
    return cpu.load() if settings.cpu_kernels else None


def group_rows(token_rows: np.ndarray) -> Rows:
    """``token_rows`` (sorted) as a slice when they are contiguous, else as they are."""
    first, last = int(token_rows[0]), int(token_rows[-1])
    if last - first + 1 == token_rows.size:
        return slice(first, last + 1)
    return token_rows
