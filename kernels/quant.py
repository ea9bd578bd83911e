"""Weights kept in llama.cpp's block formats (GGUF), and products with them on a CPU.

A ``QuantizedMatrix`` is a [rows, k] matrix of GGUF blocks, repacked when it
is made into the tiles the C kernels read (kernels/cpu/quant_kernels.c: the
same bytes, 16 rows interleaved); it is never expanded to float32 as a whole,
and once packed it no longer refers to the file it came from. A ``QuantizedWeight`` stacks one
or more of them by rows (a fused q/k/v projection whose parts were quantized
differently) and is what a dense layer's ``cpu_weight`` holds: the forward
pass and the CPU step program call its ``matmul`` without knowing the format.

Products quantize the activations per block to int8 (once per activation
format a weight needs) and run the C kernels of kernels/cpu/quant_kernels.c;
with ``settings.quantize_activations`` off (tests only) the activations stay
float32 and each weight block is expanded instead, so a product equals the
float32 product of the dequantized weights to rounding.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np
import torch

from kernels import cpu
from kernels.settings import settings


class QuantType(enum.IntEnum):
    """The formats served, by their GGML type ids (as GGUF files store them): float32 and
    float16 matrices take the same tiled layout and kernels as the block formats."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ4_NL = 20
    IQ4_XS = 23


# (values, bytes) per block (a "block" of F32 or F16 is one value).
BLOCKS = {
    QuantType.F32: (1, 4),
    QuantType.F16: (1, 2),
    QuantType.Q4_0: (32, 18),
    QuantType.Q5_0: (32, 22),
    QuantType.Q4_1: (32, 20),
    QuantType.Q5_1: (32, 24),
    QuantType.IQ4_NL: (32, 18),
    QuantType.Q8_0: (32, 34),
    QuantType.Q2_K: (256, 84),
    QuantType.Q3_K: (256, 110),
    QuantType.Q4_K: (256, 144),
    QuantType.Q5_K: (256, 176),
    QuantType.Q6_K: (256, 210),
    QuantType.IQ4_XS: (256, 136),
}


def row_bytes(qtype: QuantType, k: int) -> int:
    values, nbytes = BLOCKS[qtype]
    return k // values * nbytes


class QuantizedMatrix:
    """``rows`` x ``k`` values in ``qtype`` blocks, packed for the kernels (``data``, uint8).

    ``blocks`` is the GGUF layout, uint8 [rows, row_bytes(qtype, k)] (a view of a file, or
    a quantizer's output); packed row i is ``blocks[order[i]]`` (``order`` reorders rows in
    the same pass: llama.cpp's interleaved q/k rows)."""

    __slots__ = ("qtype", "data", "rows", "k")

    def __init__(self, qtype: QuantType, blocks: np.ndarray, rows: int, k: int,
                 order: np.ndarray | None = None) -> None:
        if k % BLOCKS[qtype][0]:
            raise ValueError(f"{qtype.name} rows hold multiples of {BLOCKS[qtype][0]} values, not {k}")
        if blocks.dtype != np.uint8 or blocks.shape != (rows, row_bytes(qtype, k)) or not blocks.flags.c_contiguous:
            raise ValueError(f"{qtype.name} data of shape {blocks.shape} does not hold {rows} rows of {k} values")
        if order is not None:
            order = np.ascontiguousarray(order, dtype=np.int64)
            if order.shape != (rows,) or (rows and (order.min() < 0 or order.max() >= rows)):
                raise ValueError(f"a row order for {rows} rows must be {rows} row numbers")
        lib = cpu.load()
        self.data = np.empty(lib.packed_bytes(qtype, rows, k), np.uint8)
        lib.pack_matrix(qtype, blocks.ctypes.data, rows, k, None if order is None else order.ctypes.data,
                        self.data.ctypes.data, torch.get_num_threads())
        self.qtype, self.rows, self.k = qtype, rows, k

    @classmethod
    def from_packed(cls, qtype: QuantType, data: np.ndarray, rows: int, k: int) -> QuantizedMatrix:
        """A matrix already in the kernels' tiles (``data``: uint8, packed_bytes of them, e.g. a
        view of kernels/packed_file.py's mapped file), taken as it is."""
        if k % BLOCKS[qtype][0]:
            raise ValueError(f"{qtype.name} rows hold multiples of {BLOCKS[qtype][0]} values, not {k}")
        need = cpu.load().packed_bytes(qtype, rows, k)
        if data.dtype != np.uint8 or data.shape != (need,):
            raise ValueError(f"{qtype.name} tiles of {rows} x {k} are {need} bytes, not {data.shape}")
        matrix = cls.__new__(cls)
        matrix.qtype, matrix.data, matrix.rows, matrix.k = qtype, data, rows, k
        return matrix

    @classmethod
    def from_floats(cls, weight: np.ndarray, order: np.ndarray | None = None) -> QuantizedMatrix:
        """A float32 or float16 [rows, k] matrix in the same tiles (kept in its own precision)."""
        qtype = QuantType.F16 if weight.dtype == np.float16 else QuantType.F32
        weight = np.ascontiguousarray(weight, dtype=np.float16 if qtype == QuantType.F16 else np.float32)
        rows, k = weight.shape
        return cls(qtype, weight.view(np.uint8).reshape(rows, -1), rows, k, order)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def take_rows(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``ids`` (int64) as float32 [len(ids), k]: an embedding lookup."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if out is None:
            out = np.empty((ids.size, self.k), np.float32)
        cpu.load().dequantize_rows(self.qtype, self.data.ctypes.data, self.k, ids.ctypes.data, ids.size,
                                   out.ctypes.data)
        return out

    def dequantize(self) -> np.ndarray:
        """The whole matrix as float32 (for a device without these kernels, and for tests)."""
        return self.take_rows(np.arange(self.rows))

    def split_rows(self, parts: int) -> list[QuantizedMatrix]:
        """The matrix as ``parts`` matrices of equal rows (a stacked tensor's experts): views of
        these tiles where a part is whole tiles, else each part packed again from the values."""
        if self.rows % parts:
            raise ValueError(f"{self.rows} rows do not split into {parts} equal parts")
        rows = self.rows // parts
        lib = cpu.load()
        size = lib.packed_bytes(self.qtype, rows, self.k)
        if size * parts == self.data.size:  # whole tiles: each part is a slice of the data
            return [QuantizedMatrix.from_packed(self.qtype, self.data[i * size : (i + 1) * size], rows, self.k)
                    for i in range(parts)]
        values = self.dequantize()
        return [QuantizedMatrix.from_floats(values[i * rows : (i + 1) * rows]) for i in range(parts)]


class QuantizedWeight:
    """A dense layer's weight [out, in] as quantized row blocks (and a float32 bias)."""

    __slots__ = ("parts", "in_features", "out_features", "bias", "_desc", "_desc_ptr")

    def __init__(self, parts: Sequence[QuantizedMatrix], bias: np.ndarray | None = None) -> None:
        if not parts or len({p.k for p in parts}) != 1:
            raise ValueError("the parts of a quantized weight must have the same number of columns")
        self.parts = list(parts)
        self.in_features = parts[0].k
        self.out_features = sum(p.rows for p in parts)
        self.bias = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
        if self.bias is not None and self.bias.shape != (self.out_features,):
            raise ValueError(f"a bias of shape {self.bias.shape} for {self.out_features} outputs")
        # What quant_linear reads: [parts, k, then per part: type, data, rows, bias (0: none)].
        desc = [len(self.parts), self.in_features]
        row = 0
        for part in self.parts:
            bias_ptr = 0 if self.bias is None else self.bias.ctypes.data + 4 * row
            desc += [int(part.qtype), part.data.ctypes.data, part.rows, bias_ptr]
            row += part.rows
        self._desc = np.array(desc, np.int64)  # keeps the pointers' owners: parts and bias, above
        self._desc_ptr = self._desc.ctypes.data

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def desc_address(self) -> int:
        """Where the C kernels read this layer's description (valid while this object lives)."""
        return self._desc_ptr

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``x [N, in] @ Wᵀ + b`` (float32, C-contiguous), into ``out`` [N, out] when given
        (rows of ``out`` may be strided: each part writes its columns in place)."""
        n = x.shape[0]
        if out is None:
            out = np.empty((n, self.out_features), np.float32)
        cpu.load().quant_linear(self._desc_ptr, x.ctypes.data, n, out.ctypes.data, out.strides[0] >> 2,
                                settings.quantize_activations, torch.get_num_threads())
        return out

    def dequantize(self) -> np.ndarray:
        """The whole weight [out, in] as float32."""
        return np.concatenate([p.dequantize() for p in self.parts])
