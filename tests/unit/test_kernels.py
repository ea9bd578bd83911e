"""The torch paged-attention path against plain dense causal attention.

Contexts are written through ``write_kv_cache`` into shuffled, non-contiguous
blocks, then every request's queries (a decode, a fresh prefill, or a chunk
after a cached prefix) are compared with attention over its dense K/V.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import kernels
from kernels import torch_ref
from kernels.settings import settings as kernel_settings
from tests.support.attention import RANDOM_BATCHES, run_case


@pytest.mark.parametrize(
    "query_lens,context_lens,kv_heads,group,head_dim,block_size",
    [
        pytest.param([1, 1, 1, 1], [4, 17, 0, 9], 2, 4, 16, 4, id="batched-decodes-gqa"),
        pytest.param([1], [30], 2, 2, 8, 8, id="single-decode"),
        pytest.param([9, 1, 20, 1, 3], [0, 12, 7, 33, 5], 2, 3, 16, 4, id="mixed-prefill-chunks-decodes"),
        pytest.param([6, 6], [0, 10], 4, 1, 32, 16, id="mha-fresh-and-chunked"),
        pytest.param([5], [0], 1, 8, 64, 1, id="block-size-one"),
    ],
)
def test_paged_attention_matches_dense(query_lens, context_lens, kv_heads, group, head_dim, block_size):
    run_case(query_lens, context_lens, kv_heads, group, head_dim, block_size)


@settings(max_examples=25, deadline=None)
@given(**RANDOM_BATCHES)
def test_paged_attention_matches_dense_random_batches(reqs, kv_heads, group, block_size, seed):
    run_case([q for q, _ in reqs], [c for _, c in reqs], kv_heads, group, 8, block_size, seed)


def test_dispatch_uses_torch_path_on_cpu_without_the_c_kernels(monkeypatch):
    """With the C kernels off, CPU tensors go to the torch kernels (and give their results), never to Triton."""
    monkeypatch.setattr(kernel_settings, "cpu_kernels", False)
    calls = []
    torch_attention = torch_ref.paged_attention

    def counted(*args, **kwargs):
        calls.append(args[0].device)
        return torch_attention(*args, **kwargs)

    monkeypatch.setattr(torch_ref, "paged_attention", counted)
    run_case([4, 1, 1], [3, 8, 2], 2, 2, 16, 4, attention=kernels.paged_attention)
    assert calls == [torch.device("cpu")]


def test_write_kv_cache_scatters_and_skips_padding_slots():
    k_cache = torch.zeros(3, 4, 2, 8)
    v_cache = torch.zeros(3, 4, 2, 8)
    key = torch.arange(3 * 2 * 8, dtype=torch.float32).view(3, 2, 8)
    kernels.write_kv_cache(key, -key, k_cache, v_cache, torch.tensor([9, -1, 2]))
    assert torch.equal(k_cache[2, 1], key[0]) and torch.equal(v_cache[2, 1], -key[0])
    assert torch.equal(k_cache[0, 2], key[2]) and torch.equal(v_cache[0, 2], -key[2])
    assert k_cache.count_nonzero() == key[0].count_nonzero() + key[2].count_nonzero()
