"""Weights kept in llama.cpp's block formats (GGUF), and products with them on a CPU.

A ``QuantizedMatrix`` is a [rows, k] matrix whose rows are GGUF blocks back
to back (a numpy view: of the memory-mapped file, or of a quantized copy);
it is never expanded to float32 as a whole. A ``QuantizedWeight`` stacks one
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
    """The block formats served, by their GGML type ids (as GGUF files store them)."""

    Q4_0 = 2
    Q5_0 = 6
    Q8_0 = 8
    Q4_K = 12
    Q6_K = 14


# (values, bytes) per block.
BLOCKS = {
    QuantType.Q4_0: (32, 18),
    QuantType.Q5_0: (32, 22),
    QuantType.Q8_0: (32, 34),
    QuantType.Q4_K: (256, 144),
    QuantType.Q6_K: (256, 210),
}
# The activation format each weight format's products take: Q8_0 (per 32) or Q8_K (per 256).
_ACTIVATION = {t: "q8_k" if BLOCKS[t][0] == 256 else "q8_0" for t in QuantType}


def row_bytes(qtype: QuantType, k: int) -> int:
    values, nbytes = BLOCKS[qtype]
    return k // values * nbytes


class QuantizedMatrix:
    """``rows`` x ``k`` values in ``qtype`` blocks: ``data`` is uint8 [rows, row_bytes(qtype, k)]."""

    __slots__ = ("qtype", "data", "rows", "k")

    def __init__(self, qtype: QuantType, data: np.ndarray, rows: int, k: int) -> None:
        if k % BLOCKS[qtype][0]:
            raise ValueError(f"{qtype.name} rows hold multiples of {BLOCKS[qtype][0]} values, not {k}")
        if data.dtype != np.uint8 or data.shape != (rows, row_bytes(qtype, k)) or not data.flags.c_contiguous:
            raise ValueError(f"{qtype.name} data of shape {data.shape} does not hold {rows} rows of {k} values")
        self.qtype, self.data, self.rows, self.k = qtype, data, rows, k

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def take_rows(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``ids`` (int64) as float32 [len(ids), k]: an embedding lookup."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if out is None:
            out = np.empty((ids.size, self.k), np.float32)
        cpu.load().dequantize_rows(self.qtype, self.data.ctypes.data, self.k, ids.ctypes.data, ids.size, out.ctypes.data)
        return out

    def dequantize(self) -> np.ndarray:
        """The whole matrix as float32 (for a device without these kernels, and for tests)."""
        return self.take_rows(np.arange(self.rows))


class QuantizedWeight:
    """A dense layer's weight [out, in] as quantized row blocks (and a float32 bias)."""

    __slots__ = ("parts", "in_features", "out_features", "bias", "_formats")

    def __init__(self, parts: Sequence[QuantizedMatrix], bias: np.ndarray | None = None) -> None:
        if not parts or len({p.k for p in parts}) != 1:
            raise ValueError("the parts of a quantized weight must have the same number of columns")
        self.parts = list(parts)
        self.in_features = parts[0].k
        self.out_features = sum(p.rows for p in parts)
        self.bias = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
        self._formats = sorted({_ACTIVATION[p.qtype] for p in parts})

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``x [N, in] @ Wᵀ + b`` (float32, C-contiguous), into ``out`` [N, out] when given
        (rows of ``out`` may be strided: each part writes its columns in place)."""
        lib = cpu.load()
        n = x.shape[0]
        if out is None:
            out = np.empty((n, self.out_features), np.float32)
        threads = torch.get_num_threads()
        k, stride = self.in_features, out.strides[0] // 4
        bias = self.bias
        quantized = {}
        if settings.quantize_activations:
            for fmt in self._formats:
                qtype = QuantType.Q4_K if fmt == "q8_k" else QuantType.Q8_0
                buf = np.empty((n, lib.activation_row_bytes(qtype, k)), np.uint8)
                lib.quantize_activations(qtype, x.ctypes.data, n, k, buf.ctypes.data)
                quantized[fmt] = buf
        column = 0
        for part in self.parts:
            out_p = out.ctypes.data + 4 * column
            bias_p = None if bias is None else bias.ctypes.data + 4 * column
            if settings.quantize_activations:
                xq = quantized[_ACTIVATION[part.qtype]]
                lib.quant_matmul(part.qtype, part.data.ctypes.data, part.rows, k, xq.ctypes.data, n, out_p, stride,
                                 bias_p, threads)
            else:
                lib.quant_matmul_f32(part.qtype, part.data.ctypes.data, part.rows, k, x.ctypes.data, n, out_p,
                                     stride, bias_p, threads)
            column += part.rows
        return out

    def dequantize(self) -> np.ndarray:
        """The whole weight [out, in] as float32."""
        return np.concatenate([p.dequantize() for p in self.parts])
