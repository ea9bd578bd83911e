"""Triton kernels against a dense reference: under TRITON_INTERPRET=1 on CPU
(small shapes: the interpreter is slow), and at real shapes on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.metadata import AttentionMetadata

triton_attention = pytest.importorskip("kernels.triton_attention")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_batch(query_lens, context_lens, kv_heads, qpk, head_dim, block_size, num_blocks, dtype, seed=0):
    """Random K/V per request, scattered into a paged cache via shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * qpk
    seq_lens = [c + q for q, c in zip(query_lens, context_lens)]
    max_blocks = max((s + block_size - 1) // block_size for s in seq_lens)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # block 0 stays a padding block
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    keys, values, used = [], [], 0
    for r, s in enumerate(seq_lens):
        nb = (s + block_size - 1) // block_size
        block_tables[r, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
        keys.append(torch.randn(s, kv_heads, head_dim, generator=g).to(dtype))
        values.append(torch.randn(s, kv_heads, head_dim, generator=g).to(dtype))
    query = torch.randn(sum(query_lens), heads, head_dim, generator=g).to(dtype)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    return query, keys, values, k_cache, v_cache, meta


def dense_reference(query, keys, values, meta, qpk, scale):
    out = torch.empty_like(query, dtype=torch.float32)
    for r in range(meta.num_reqs):
        a, b = meta.query_start_loc_cpu[r], meta.query_start_loc_cpu[r + 1]
        s = meta.seq_lens_cpu[r]
        q = query[a:b].float().transpose(0, 1)  # [H, q, D]
        k = keys[r].float().repeat_interleave(qpk, dim=1).transpose(0, 1)
        v = values[r].float().repeat_interleave(qpk, dim=1).transpose(0, 1)
        scores = q @ k.transpose(1, 2) * scale
        pos = torch.arange(s - (b - a), s)[:, None]
        scores = scores.masked_fill(torch.arange(s)[None, :] > pos, float("-inf"))
        out[a:b] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out


def slot_mapping_for_all(meta, block_size):
    """Slots of every context token of every request, in request order."""
    slots = []
    for r, s in enumerate(meta.seq_lens_cpu):
        pos = torch.arange(s)
        slots.append(meta.block_tables[r, pos // block_size].long() * block_size + pos % block_size)
    return torch.cat(slots)


def to_device(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(
        **{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in vars(meta).items()}
    )


CASES = [
    # query_lens, context_lens, kv_heads, qpk, head_dim, block_size
    pytest.param([1, 1, 1], [5, 17, 3], 2, 2, 16, 4, id="decodes-gqa"),
    pytest.param([7, 1, 20, 1], [0, 9, 6, 30], 2, 4, 32, 8, id="mixed-prefill-decode"),
    pytest.param([5, 3], [11, 0], 3, 1, 8, 4, id="mha-small-headdim"),
    pytest.param([1, 4], [40, 2], 1, 3, 16, 16, id="qpk-not-power-of-two"),
]


@pytest.mark.parametrize("query_lens,context_lens,kv_heads,qpk,head_dim,block_size", CASES)
def test_write_then_paged_attention_matches_dense(query_lens, context_lens, kv_heads, qpk, head_dim, block_size):
    query, keys, values, k_cache, v_cache, meta = make_batch(
        query_lens, context_lens, kv_heads, qpk, head_dim, block_size, num_blocks=64, dtype=torch.float32
    )
    # Write every context token through the Triton cache-write kernel.
    slots = slot_mapping_for_all(meta, block_size)
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    triton_attention.write_kv_cache(
        torch.cat(keys).to(DEVICE), torch.cat(values).to(DEVICE), k_cache, v_cache, slots.to(DEVICE)
    )
    scale = head_dim**-0.5
    out = triton_attention.paged_attention(query.to(DEVICE), k_cache, v_cache, to_device(meta), scale)
    expected = dense_reference(query, keys, values, meta, qpk, scale)
    torch.testing.assert_close(out.cpu().float(), expected, atol=2e-4, rtol=2e-4)


def test_write_kv_cache_skips_padding_slots():
    key = torch.ones(2, 1, 16)
    k_cache = torch.zeros(4, 4, 1, 16)
    v_cache = torch.zeros(4, 4, 1, 16)
    triton_attention.write_kv_cache(
        key.to(DEVICE), (2 * key).to(DEVICE), k_cache := k_cache.to(DEVICE), v_cache := v_cache.to(DEVICE),
        torch.tensor([5, -1]).to(DEVICE),
    )
    assert k_cache.cpu()[1, 1].eq(1).all() and v_cache.cpu()[1, 1].eq(2).all()
    assert k_cache.cpu().sum() == 16  # only one token written


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_paged_attention_bf16_real_shapes():
    query_lens = [1] * 30 + [300, 77]
    context_lens = [500 + 13 * i for i in range(30)] + [0, 1000]
    query, keys, values, k_cache, v_cache, meta = make_batch(
        query_lens, context_lens, 8, 4, 128, 16, num_blocks=2048, dtype=torch.bfloat16
    )
    slots = slot_mapping_for_all(meta, 16)
    k_cache, v_cache = k_cache.cuda(), v_cache.cuda()
    triton_attention.write_kv_cache(torch.cat(keys).cuda(), torch.cat(values).cuda(), k_cache, v_cache, slots.cuda())
    out = triton_attention.paged_attention(query.cuda(), k_cache, v_cache, to_device(meta), 128**-0.5)
    expected = dense_reference(query, keys, values, meta, 4, 128**-0.5)
    torch.testing.assert_close(out.float().cpu(), expected, atol=3e-2, rtol=3e-2)
