"""Dense layers ``y = x Wᵀ + b`` on a CPU: one row through numpy's BLAS, a few through our own
kernel, more through oneDNN.

A decode step multiplies a few rows by every weight matrix once, so it runs
at the speed the weights stream from memory. For a single row that is a
matrix-vector product, and the OpenBLAS bundled with numpy streams the
weights as loaded at about twice the bandwidth torch's MKL reaches on AMD
processors (whose dispatch falls back to a generic kernel there). For a few
rows, a BLAS ``gemm`` repacks the whole weight matrix on every call, which
for a large matrix costs more than the product itself; so a weight may also
have a copy prepacked once in oneDNN's blocked layout (torch's mkldnn linear,
as inductor uses it on CPUs), which decode batches of two rows or more then
go through. Which path wins depends on the shape, the caches and the thread
pools (oneDNN's fixed cost per call outweighs the repacking of a small
matrix), so each weight times both on a decode-sized batch when it is
prepared, in the process that serves, and keeps the packed copy only if it
was faster. The copy costs the weight's memory again: ``settings.cpu_prepack``
off (``RINGLLM_CPU_PREPACK=0``) goes without it (numpy for every batch),
``settings.cpu_blas`` off (``RINGLLM_CPU_BLAS=0``) keeps torch's own kernels
altogether. Other dtypes and devices keep torch's kernels. Up to
``dense_few_rows_max()`` rows (a speculative verification, a small decode
batch) go through kernels/cpu's ``dense_few_rows`` when it is built: it reads
each weight row once for all of them, as the one-row product does, where
oneDNN and BLAS both pay a fixed cost per call that a few rows do not repay
(single rows too with ``settings.few_rows_for_one``, which an engine sets for
models whose weights are not all small).

Both libraries release the GIL inside the product, so the engine's I/O
threads run meanwhile. The forward pass and the CPU step program
(core/worker/cpu_program.py) call the same ``CpuWeight.matmul``, so they give
the same bits for the same batch.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from kernels import cpu
from kernels.settings import settings

# Batches of 2 to PACKED_MAX_ROWS rows (decode batches) use the packed copy, laid out for
# that many rows. Larger ones (prefill chunks) stay with numpy: in the served engine they
# ran faster there, though oneDNN won when timed alone.
PACKED_MAX_ROWS = 64
# Weights up to this size stay in a core's caches, and their products gain little from
# BLAS's second thread (a few microseconds on a 128-row chunk), while that thread, waiting
# for its next share, spins on the core the frontend and the client need: served, a model
# made only of such weights runs faster on one BLAS thread (bench/README.md).
SMALL_WEIGHT_BYTES = 1 << 20
# The decode batch both paths are timed on when a weight is prepared, and the timed calls of each.
TUNE_ROWS = 16
TUNE_CALLS = 5


def _prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of ``weight`` [out, in], or None where oneDNN is not available."""
    if weight.numel() == 0 or not torch.backends.mkldnn.is_available():
        return None  # (no weight at all: the model sleeps)
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_MAX_ROWS)
    except (RuntimeError, AttributeError):
        return None


def _fastest_call(call: object) -> float:
    """The shortest of TUNE_CALLS timed calls of ``call()``, after one untimed."""
    call()  # type: ignore[operator]
    best = float("inf")
    for _ in range(TUNE_CALLS):
        start = time.perf_counter()
        call()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best


def _packed_is_faster(weight_t: np.ndarray, packed: torch.Tensor) -> bool:
    """Whether a TUNE_ROWS-row product is faster through ``packed`` than through numpy."""
    x = np.random.default_rng(0).standard_normal((TUNE_ROWS, weight_t.shape[0]), dtype=np.float32)
    x_t = torch.from_numpy(x)
    with torch.inference_mode():
        onednn = _fastest_call(lambda: torch.ops.mkldnn._linear_pointwise(x_t, packed, None, "none", [], ""))
    blas = _fastest_call(lambda: np.matmul(x, weight_t))
    return onednn < blas


class CpuWeight:
    """A CPU float32 weight (and bias) ready for products: numpy views, and a packed copy.

    Made once the weights are loaded, and again whenever they change
    (``prepare_for_inference``), so the packed copy never goes stale.
    """

    __slots__ = ("weight_t", "bias", "packed", "bias_tensor", "few_rows", "_few_rows_lib")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: str = "auto") -> None:
        """``pack``: "auto" (keep the packed copy if it is the faster path), "always" or "never"."""
        weight = weight.detach()
        self.weight_t = weight.numpy().T  # [in, out], a transposed view: BLAS reads it as is
        self.bias_tensor = None if bias is None else bias.detach()
        self.bias = None if bias is None else self.bias_tensor.numpy()
        packed = None if pack == "never" or not settings.cpu_prepack and pack == "auto" else _prepack(weight)
        if packed is not None and pack == "auto" and not _packed_is_faster(self.weight_t, packed):
            packed = None
        self.packed = packed
        lib = _few_rows_library() if self.weight_t.T.flags.c_contiguous else None
        self._few_rows_lib = lib
        self.few_rows = lib.dense_few_rows_max() if lib is not None else 1  # most rows it takes

    @staticmethod
    def usable(weight: torch.Tensor) -> bool:
        return settings.cpu_blas and weight.device.type == "cpu" and weight.dtype == torch.float32

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``x [N, in] @ Wᵀ + b``, into ``out`` [N, out] when given (``x`` C-contiguous)."""
        rows = x.shape[0]
        if (rows > 1 or settings.few_rows_for_one) and rows <= self.few_rows and x.flags.c_contiguous:
            return self._few_rows(x, out)
        if self.packed is None or not 1 < rows <= PACKED_MAX_ROWS:
            out = np.matmul(x, self.weight_t, out=out)
            if self.bias is not None:
                out += self.bias
            return out
        y = torch.ops.mkldnn._linear_pointwise(torch.from_numpy(x), self.packed, self.bias_tensor, "none", [], "")
        if out is None:
            return y.numpy()
        out[...] = y.numpy()
        return out


    def _few_rows(self, x: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        k, n = self.weight_t.shape
        if out is None:
            out = np.empty((x.shape[0], n), np.float32)
        assert out.strides[1] == 4
        self._few_rows_lib.dense_few_rows(  # type: ignore[union-attr]
            x.ctypes.data, x.shape[0], k, self.weight_t.ctypes.data, n, k,
            None if self.bias is None else self.bias.ctypes.data, out.ctypes.data, out.strides[0] // 4,
            torch.get_num_threads(),
        )
        return out


def _few_rows_library():
    """kernels/cpu's library for ``dense_few_rows``, or None (not built here, or products through torch)."""
    if not settings.cpu_blas:
        return None
    return cpu.load()  # built on first use


class DenseRows:
    """A float32 table whose rows are looked up by id (an embedding, as the quantized one is)."""

    __slots__ = ("table",)

    def __init__(self, table: np.ndarray) -> None:
        self.table = table

    def take_rows(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        return np.take(self.table, ids, axis=0, out=out)


def all_small(weights: list[object]) -> bool:
    """Whether every float weight among ``weights`` (there being some) is at most SMALL_WEIGHT_BYTES."""
    dense = [w for w in weights if isinstance(w, CpuWeight)]
    return bool(dense) and all(w.weight_t.nbytes <= SMALL_WEIGHT_BYTES for w in dense)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, cpu: CpuWeight | None = None
) -> torch.Tensor:
    """``x [N, in] @ weight[out, in]ᵀ + bias``; with ``cpu`` (the weight's CpuWeight)
    on the CPU path above, else torch's."""
    if cpu is not None and x.dtype == torch.float32:
        return torch.from_numpy(cpu.matmul(x.contiguous().numpy()))
    return F.linear(x, weight, bias)
