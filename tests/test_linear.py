"""CPU dense products (kernels/linear.py): numpy for one row or a prefill, oneDNN's packed copy for decode batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels import linear as lin


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", [1, 2, 16, lin.PACKED_MAX_ROWS, lin.PACKED_MAX_ROWS + 1, 200])
def test_products_equal_torch(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 80, generator=g)
    cpu = lin.CpuWeight(weight, b)
    want = F.linear(x, weight, b)
    torch.testing.assert_close(lin.linear(x, weight, b, cpu), want, rtol=1e-5, atol=1e-5)
    out = np.full((rows, 96), np.nan, np.float32)
    assert cpu.matmul(x.numpy(), out) is out  # into the caller's buffer, as the decode program uses it
    torch.testing.assert_close(torch.from_numpy(out), want, rtol=1e-5, atol=1e-5)


def test_packed_copy_where_onednn_is_available() -> None:
    cpu = lin.CpuWeight(torch.randn(8, 8), None)
    if lin.CPU_PREPACK and torch.backends.mkldnn.is_available():
        assert cpu.packed is not None and cpu.packed.is_mkldnn
    else:
        assert cpu.packed is None
