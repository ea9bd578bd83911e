"""The q8_0 KV cache (``--kv-cache-dtype q8_0``): rows quantized as llama.cpp quantizes Q8_0
(the gguf package's reference, which its authors keep bit-exact with ggml-quants.c), by the C
write kernel and by the torch reference alike; attention over such a cache, in the C kernels
and the torch reference, against dense float64 attention over the dequantized keys and values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

import kernels
from kernels import cpu, torch_ref
from kernels.kv_format import Q8_0_BYTES, dequantize_q8_0, quantize_q8_0, row_width
from tests.support.attention import run_case

Q8 = torch.uint8  # the storage of a q8_0 cache


def _rows(seed: int, tokens: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(tokens, kv_heads, head_dim, generator=g) * torch.rand(tokens, kv_heads, 1, generator=g) * 8
    rows[0, 0, :32] = 0.0  # a block of zeros: scale 0
    # max|x| 63.5: scale 0.5 and 1/scale 2 exactly, so -7.75, -7.25, ... scale to -15.5, -14.5, ...:
    # every one a tie, which C's roundf sends away from zero (round-half-even would not)
    rows[1, 0, :31] = torch.arange(31) * 0.5 - 7.75
    rows[1, 0, 31] = 63.5
    return rows


def test_the_torch_rows_are_the_gguf_reference_bytes() -> None:
    rows = _rows(0, 5, 2, 128)
    theirs = quants.quantize(rows.reshape(-1, 128).numpy(), GGMLQuantizationType.Q8_0)
    ours = quantize_q8_0(rows).reshape(-1, 128 // 32 * Q8_0_BYTES).numpy()
    assert np.array_equal(ours, theirs)
    back = quants.dequantize(theirs, GGMLQuantizationType.Q8_0)
    assert np.array_equal(dequantize_q8_0(torch.from_numpy(ours)).numpy(), back)


@pytest.mark.skipif(cpu.load() is None, reason="no C compiler to build kernels/cpu with")
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_the_c_write_kernel_stores_the_reference_bytes(head_dim: int) -> None:
    key, value = _rows(1, 9, 3, head_dim), _rows(2, 9, 3, head_dim) * -1
    width = row_width(Q8, head_dim)
    caches = [torch.zeros(6, 4, 3, width, dtype=Q8) for _ in range(4)]
    slots = torch.tensor([9, -1, 2, 20, 21, 0, 13, 7, 23])
    cpu.write_kv(key, value, caches[0], caches[1], slots)
    torch_ref.write_kv_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    stored = caches[0].view(-1, 3, width)[slots[slots >= 0]]
    keep = (slots >= 0).numpy()
    theirs = quants.quantize(key.numpy()[keep].reshape(-1, head_dim), GGMLQuantizationType.Q8_0)
    assert np.array_equal(stored.reshape(-1, width).numpy(), theirs)


@pytest.mark.parametrize("case", [
    pytest.param(([1, 1, 1, 1], [4, 17, 0, 9], 2, 4, 32, 4), id="batched-decodes-gqa"),
    pytest.param(([1] * 24 + [12], [100 + 7 * i for i in range(24)] + [30], 4, 3, 64, 16), id="threads"),
    pytest.param(([40, 1, 17], [0, 9, 30], 2, 2, 64, 16), id="prefill-chunks-and-decodes"),
    pytest.param(([130], [0], 2, 4, 128, 16), id="prefill-chunk-head-dim-128"),
])
@pytest.mark.parametrize("attention", ["c", "torch"])
def test_attention_reads_the_quantized_cache(case, attention: str) -> None:
    """Both kernels agree with dense float64 attention over what the cache holds."""
    if attention == "c" and cpu.load() is None:
        pytest.skip("no C compiler to build kernels/cpu with")
    run_case(*case, attention=kernels.paged_attention if attention == "c" else torch_ref.paged_attention,
             cache_dtype=Q8)


def test_a_head_that_is_not_whole_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple"):
        row_width(Q8, 48)
