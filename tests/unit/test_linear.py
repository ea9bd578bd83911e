"""CPU dense products (kernels/linear.py): numpy for one row or a prefill, oneDNN's packed copy for decode batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels import linear as lin

onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch was built without oneDNN")


@pytest.mark.parametrize("pack", ["never", pytest.param("always", marks=onednn)])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", [1, 2, 16, lin.PACKED_MAX_ROWS, lin.PACKED_MAX_ROWS + 1, 200])
def test_products_equal_torch(rows: int, bias: bool, pack: str) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 80, generator=g)
    cpu = lin.CpuWeight(weight, b, pack)
    assert (cpu.packed is not None) == (pack == "always")
    want = F.linear(x, weight, b)
    torch.testing.assert_close(lin.linear(x, weight, b, cpu), want, rtol=1e-5, atol=1e-5)
    out = np.full((rows, 96), np.nan, np.float32)
    assert cpu.matmul(x.numpy(), out) is out  # into the caller's buffer, as the CPU step program uses it
    torch.testing.assert_close(torch.from_numpy(out), want, rtol=1e-5, atol=1e-5)


def test_auto_keeps_a_packed_copy_only_of_onednn_and_gives_the_same_products() -> None:
    weight, x = torch.randn(64, 48), torch.randn(8, 48)
    cpu = lin.CpuWeight(weight, None)  # "auto": timed here, either path may win
    assert cpu.packed is None or cpu.packed.is_mkldnn
    torch.testing.assert_close(torch.from_numpy(cpu.matmul(x.numpy())), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_no_copy_of_a_dropped_weight() -> None:
    """A sleeping model's weights have no storage: nothing to pack or time."""
    assert lin.CpuWeight(torch.empty(0, 0), None, "always").packed is None


def test_a_model_is_small_when_every_weight_is() -> None:
    """The rule behind the engine's one BLAS thread: all weights at most SMALL_WEIGHT_BYTES."""
    side = int((lin.SMALL_WEIGHT_BYTES // 4) ** 0.5)  # a square float32 weight of exactly the limit
    at_limit = lin.CpuWeight(torch.zeros(side, side), None, "never")
    over = lin.CpuWeight(torch.zeros(side + 1, side), None, "never")
    assert lin.all_small([at_limit, at_limit])
    assert not lin.all_small([at_limit, over])
    assert not lin.all_small([])


@pytest.mark.skipif(lin.cpu.load() is None, reason="no C compiler to build kernels/cpu with")
@pytest.mark.parametrize("shape", [(96, 80), (37, 203), (5000, 64)], ids=["even", "odd", "tall"])
def test_few_rows_equal_torch_and_a_row_has_the_same_bits_in_any_batch(shape, monkeypatch) -> None:
    """Up to dense_few_rows_max() rows through kernels/cpu's dense_few_rows (odd sizes: its
    vector tails and its last weight rows taken one at a time); a row's product does not
    depend on how many rows share the call, which keeps greedy speculative decoding exact."""
    monkeypatch.setattr(lin.settings, "few_rows_for_one", True)
    n, k = shape
    g = torch.Generator().manual_seed(n)
    weight, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    cpu = lin.CpuWeight(weight, b, "never")
    assert cpu.few_rows == lin.cpu.load().dense_few_rows_max() >= 5
    x = torch.randn(cpu.few_rows, k, generator=g)
    alone = [cpu.matmul(np.ascontiguousarray(x[r : r + 1].numpy())) for r in range(cpu.few_rows)]
    for rows in range(1, cpu.few_rows + 1):
        out = cpu.matmul(x[:rows].numpy())
        torch.testing.assert_close(torch.from_numpy(out), F.linear(x[:rows], weight, b), rtol=1e-4, atol=1e-4)
        assert all(np.array_equal(out[r], alone[r][0]) for r in range(rows))
