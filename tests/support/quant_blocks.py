"""Valid random weight data in GGUF's block formats, for the quantized kernels' tests and GGUF files."""

from __future__ import annotations

import gguf
import numpy as np

from kernels.quant import BLOCKS, QuantType, row_bytes


def random_blocks(qtype: QuantType, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid random data of ``qtype``: the gguf quantizer's where it has one, else random
    bits with finite, modest half-precision scales (every bit pattern of the rest is valid)."""
    rng = np.random.default_rng(seed)
    if qtype in (QuantType.F32, QuantType.F16):
        values = rng.standard_normal((rows, k)).astype(np.float32 if qtype == QuantType.F32 else np.float16)
        return values.view(np.uint8).reshape(rows, -1)
    if qtype in (QuantType.Q4_0, QuantType.Q5_0, QuantType.Q4_1, QuantType.Q5_1, QuantType.Q8_0):
        values = rng.standard_normal((rows, k)).astype(np.float32)
        return gguf.quants.quantize(values, gguf.GGMLQuantizationType(qtype))
    values, nbytes = BLOCKS[qtype]
    data = rng.integers(0, 256, (rows, k // values, nbytes), dtype=np.uint8)

    def halves(low: float = 0.001, high: float = 0.02) -> np.ndarray:
        return rng.uniform(low, high, (rows, k // values)).astype(np.float16).view(np.uint8).reshape(rows, -1, 2)

    if qtype in (QuantType.IQ4_XS, QuantType.IQ4_NL):  # d first; values reach 127 (not 15 or 31): a smaller d
        data[:, :, 0:2] = halves(0.000125, 0.0025)
    elif qtype == QuantType.Q2_K:  # d and dmin last
        data[:, :, -4:-2], data[:, :, -2:] = halves(), halves()
    elif qtype in (QuantType.Q4_K, QuantType.Q5_K):  # d and dmin first
        data[:, :, 0:2], data[:, :, 2:4] = halves(), halves()
    else:  # Q3_K and Q6_K: d last
        data[:, :, -2:] = halves()
    return data.reshape(rows, row_bytes(qtype, k))
