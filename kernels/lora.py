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

On a CPU, in float32, kernels/cpu's ``lora_add`` computes them on the arrays the
layers already use (the forward pass's tensors share their memory), from a
descriptor of the step's groups that the batch writes once per step for each
adapted product, at a fixed address: the forward pass, the CPU step program
and the one-call C program (core/worker/cpu_program.py, which points its
``LORA`` operations at those descriptors) add the same bits. Without the C
kernels numpy's BLAS does it; elsewhere torch's ``addmm``/``index_add_`` on the
device. Rows are a
slice when the group's rows are contiguous (the scheduler orders a step's
requests by adapter for that), else an index array.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kernels import cpu

Rows = slice | np.ndarray


@dataclass(frozen=True)
class LoRAGroup:
    """One adapter's rows of a step: its products by (layer, product name), and the rows."""

    products: dict[tuple[int, str], Any]  # -> core.lora.weights.LoRAProduct
    rows: Rows
    rows_t: torch.Tensor | None  # ``rows`` as a device index tensor (torch path, non-contiguous rows)


# Descriptor words: the group count; per group 6 (first row, row count, row list, a_t, rank,
# part count); per part 5 (first column, column count, first rank, rank count, b).
_GROUP_WORDS, _PART_WORDS, _MAX_PARTS = 6, 5, 3


class LoRABatch:
    """The adapter groups of the step being run, shared by every adapted product of a model
    (the runner sets them before each step), and each product's descriptor of them for the
    C kernel: fixed arrays, rewritten whenever the groups change."""

    __slots__ = ("_groups", "descs", "capacity", "_lib")

    def __init__(self, capacity: int = 4, native: bool = True) -> None:
        """``capacity``: the most groups (adapters) one step may hold; ``native``: the adapters are
        float32 on a CPU, for the C kernel (built here) to add."""
        self._groups: list[LoRAGroup] = []
        self.capacity = capacity
        self.descs: dict[tuple[int, str], np.ndarray] = {}
        self._lib = cpu.load() if native else None

    @property
    def groups(self) -> list[LoRAGroup]:
        return self._groups

    @groups.setter
    def groups(self, groups: list[LoRAGroup]) -> None:
        if len(groups) > self.capacity:
            raise ValueError(f"{len(groups)} adapters in a step, more than the {self.capacity} made room for")
        self._groups = groups
        for key, desc in self.descs.items():
            self._describe(key, desc)

    def register(self, key: tuple[int, str]) -> np.ndarray | None:
        """The descriptor the C kernel reads for product ``key`` (None without the kernel)."""
        if self._lib is None:
            return None
        desc = self.descs.get(key)
        if desc is None:
            desc = self.descs[key] = np.zeros(1 + self.capacity * (_GROUP_WORDS + _MAX_PARTS * _PART_WORDS), np.int64)
            self._describe(key, desc)
        return desc

    def _describe(self, key: tuple[int, str], desc: np.ndarray) -> None:
        at, count = 1, 0
        for group in self._groups:
            product = group.products.get(key)
            if product is None:
                continue
            if product.a_np is None or product.a_np.shape[1] > self._lib.lora_max_rank():
                raise ValueError(f"LoRA product {key}: not float32 on a CPU, or a rank above the kernel's")
            rows = group.rows
            if isinstance(rows, slice):
                first, size, listed = rows.start, rows.stop - rows.start, 0
            else:
                first, size, listed = 0, rows.size, rows.ctypes.data
            a = product.a_np
            desc[at : at + _GROUP_WORDS] = (first, size, listed, a.ctypes.data, a.shape[1], len(product.parts))
            at += _GROUP_WORDS
            for part in product.parts:
                b = part.b_np
                desc[at : at + _PART_WORDS] = (part.columns.start, part.columns.stop - part.columns.start,
                                               part.ranks.start, part.ranks.stop - part.ranks.start, b.ctypes.data)
                at += _PART_WORDS
            count += 1
        desc[0] = count


class LoRASlot:
    """An adapted product of the model: which one it is, and the batch it reads its groups from."""

    __slots__ = ("batch", "key", "desc")

    def __init__(self, batch: LoRABatch, key: tuple[int, str]) -> None:
        self.batch = batch
        self.key = key
        self.desc = batch.register(key)  # the C kernel's view of the step's groups for this product

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
        if self.desc is not None:
            if self.desc[0]:
                self.batch._lib.lora_add(
                    self.desc.ctypes.data, x.ctypes.data, x.strides[0] // 4, y.ctypes.data, y.strides[0] // 4,
                    x.shape[1],
                )
            return
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
