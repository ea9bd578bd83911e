"""Triton kernels against a dense reference and the torch path: under
TRITON_INTERPRET=1 on CPU (small token counts: the interpreter is slow, but
real head dims, block sizes and GQA ratios), and at real shapes on a GPU.

The interpreter cannot check bfloat16: its ``tl.dot`` multiplies bfloat16 bit
patterns (triton-lang/triton#11584), so bfloat16 runs only on a GPU and the
interpreter covers the half-precision path with float16.
"""

from __future__ import annotations

import pytest
import torch

from kernels import torch_ref
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


def dense_reference(query, keys, values, meta, qpk, scale, window=0):
    """Causal attention of each request's queries over its keys (the last ``window`` positions
    up to each query's own with a sliding window > 0), dense, float32."""
    out = torch.empty_like(query, dtype=torch.float32)
    for r in range(meta.num_reqs):
        a, b = meta.query_start_loc_cpu[r], meta.query_start_loc_cpu[r + 1]
        s = meta.seq_lens_cpu[r]
        q = query[a:b].float().transpose(0, 1)  # [H, q, D]
        k = keys[r].float().repeat_interleave(qpk, dim=1).transpose(0, 1)
        v = values[r].float().repeat_interleave(qpk, dim=1).transpose(0, 1)
        scores = q @ k.transpose(1, 2) * scale
        pos = torch.arange(s - (b - a), s)[:, None]
        keys_at = torch.arange(s)[None, :]
        hidden = keys_at > pos
        if window:
            hidden |= keys_at <= pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
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


def written_batch(query_lens, context_lens, kv_heads, qpk, head_dim, block_size, dtype, num_blocks=None):
    """A batch whose whole context went into the cache through the Triton write kernel."""
    if num_blocks is None:
        num_blocks = sum(-(-(q + c) // block_size) for q, c in zip(query_lens, context_lens)) + 4
    query, keys, values, k_cache, v_cache, meta = make_batch(
        query_lens, context_lens, kv_heads, qpk, head_dim, block_size, num_blocks, dtype
    )
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    slots = slot_mapping_for_all(meta, block_size).to(DEVICE)
    triton_attention.write_kv_cache(torch.cat(keys).to(DEVICE), torch.cat(values).to(DEVICE), k_cache, v_cache, slots)
    return query.to(DEVICE), keys, values, k_cache, v_cache, meta


CASES = [
    # query_lens, context_lens, kv_heads, qpk, head_dim, block_size
    pytest.param([1, 1, 1], [5, 17, 3], 2, 2, 16, 4, id="decodes-gqa"),
    pytest.param([7, 1, 20, 1], [0, 9, 6, 30], 2, 4, 32, 8, id="mixed-prefill-decode"),
    pytest.param([5, 3], [11, 0], 3, 1, 8, 4, id="mha-small-headdim"),
    pytest.param([1, 4], [40, 2], 1, 3, 16, 16, id="qpk-not-power-of-two"),
    # Real head dims and block sizes. Decodes only (16-row tiles), a context
    # spanning dozens of key tiles, and an empty context before one token.
    pytest.param([1, 1, 1], [600, 33, 0], 2, 8, 128, 16, id="decodes-long-context-gqa8-d128"),
    # A 70-token chunk after a 50-token prefix: two 64-token tiles, the
    # second of which must see keys up to the chunk's end and no further.
    pytest.param([70, 1], [50, 200], 1, 1, 64, 32, id="chunk-two-tiles-mha-d64-bs32"),
    # GQA 4 packs 16 tokens per tile: a 40-token chunk spans three tiles.
    pytest.param([40, 1, 3], [17, 100, 0], 2, 4, 64, 16, id="chunk-three-tiles-gqa4-d64"),
    pytest.param([5, 1], [10, 20], 2, 2, 96, 16, id="head-dim-not-power-of-two"),
]


@pytest.mark.parametrize("query_lens,context_lens,kv_heads,qpk,head_dim,block_size", CASES)
def test_write_then_paged_attention_matches_dense(query_lens, context_lens, kv_heads, qpk, head_dim, block_size):
    query, keys, values, k_cache, v_cache, meta = written_batch(
        query_lens, context_lens, kv_heads, qpk, head_dim, block_size, torch.float32
    )
    scale = head_dim**-0.5
    out = triton_attention.paged_attention(query, k_cache, v_cache, to_device(meta), scale)
    expected = dense_reference(query.cpu(), keys, values, meta, qpk, scale)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-4, rtol=2e-4)
    # ...and the torch path (the CPU backend) over the same paged cache.
    reference = torch_ref.paged_attention(query.cpu(), k_cache.cpu(), v_cache.cpu(), meta, scale)
    torch.testing.assert_close(out.cpu(), reference, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("window", [1, 5, 24])
@pytest.mark.parametrize("query_lens,context_lens,kv_heads,qpk,head_dim,block_size", [CASES[1], CASES[6]])
def test_sliding_windows_match_the_masked_dense_attention(
    query_lens, context_lens, kv_heads, qpk, head_dim, block_size, window
):
    """Every attention path given a window: Triton, the torch reference (decodes batched, chunks
    through SDPA) and the C kernels (kernels.paged_attention on a CPU: decodes, chunks at once or a
    query at a time), against the dense attention masked to each query's window."""
    import kernels
    from kernels.settings import configure, settings

    query, keys, values, k_cache, v_cache, meta = written_batch(
        query_lens, context_lens, kv_heads, qpk, head_dim, block_size, torch.float32
    )
    scale = head_dim**-0.5
    expected = dense_reference(query.cpu(), keys, values, meta, qpk, scale, window)
    out = triton_attention.paged_attention(query, k_cache, v_cache, to_device(meta), scale, window=window)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-4, rtol=2e-4)
    q, kc, vc = query.cpu(), k_cache.cpu(), v_cache.cpu()
    torch.testing.assert_close(torch_ref.paged_attention(q, kc, vc, meta, scale, window=window), expected,
                               atol=2e-4, rtol=2e-4)
    limit = settings.prefill_pairs
    try:
        for pairs in (limit, 0):  # chunks by the C kernels, then by SDPA
            configure(prefill_pairs=pairs)
            fresh = AttentionMetadata(**{**vars(meta), "cpu_plan": None})
            got = kernels.paged_attention(q, kc, vc, fresh, scale, window=window)
            torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)
    finally:
        configure(prefill_pairs=limit)


def test_paged_attention_float16_matches_dense():
    """Half precision: fp16 K/V tiles and probabilities, float32 accumulation."""
    query, keys, values, k_cache, v_cache, meta = written_batch(
        [40, 1, 3], [17, 100, 0], 2, 4, 64, 16, torch.float16
    )
    out = triton_attention.paged_attention(query, k_cache, v_cache, to_device(meta), 64**-0.5)
    assert out.dtype == torch.float16
    expected = dense_reference(query.cpu(), keys, values, meta, 4, 64**-0.5)
    torch.testing.assert_close(out.cpu().float(), expected, atol=3e-3, rtol=3e-3)


def test_padded_decode_rows_leave_real_rows_and_cache_untouched():
    """The CUDA-graph padding: filler tokens with slot -1, seq_len 1 and block 0.

    The real rows' outputs must be bit-identical to the unpadded launch (each
    program owns one request), and the fillers must write nothing.
    """
    query, _, _, k_cache, v_cache, meta = written_batch([1, 1, 1], [40, 7, 19], 2, 4, 64, 16, torch.float32)
    scale = 64**-0.5
    plain = triton_attention.paged_attention(query, k_cache, v_cache, to_device(meta), scale)

    real, total = 3, 8
    pad = total - real
    padded_meta = AttentionMetadata(
        slot_mapping=torch.tensor([5, 9, 13] + [-1] * pad),  # real slots are irrelevant: re-written below
        query_start_loc=torch.arange(total + 1, dtype=torch.int32),
        seq_lens=torch.tensor(meta.seq_lens_cpu + [1] * pad, dtype=torch.int32),
        block_tables=torch.cat([meta.block_tables, torch.zeros(pad, meta.block_tables.shape[1], dtype=torch.int32)]),
        max_query_len=1,
        max_seq_len=max(meta.seq_lens_cpu),
        query_start_loc_cpu=list(range(total + 1)),
        seq_lens_cpu=meta.seq_lens_cpu + [1] * pad,
    )
    padded_query = torch.cat([query, torch.randn(pad, *query.shape[1:], device=DEVICE)])
    before_k, before_v = k_cache.clone(), v_cache.clone()
    filler_kv = torch.full((pad, 2, 64), 7.0, device=DEVICE)
    triton_attention.write_kv_cache(
        filler_kv, filler_kv, k_cache, v_cache, padded_meta.slot_mapping[real:].to(DEVICE)
    )
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)
    out = triton_attention.paged_attention(padded_query, k_cache, v_cache, to_device(padded_meta), scale)
    assert torch.equal(out[:real], plain)


def test_write_kv_cache_takes_strided_slices_of_a_fused_projection():
    """k and v as the model makes them: column slices of one qkv matmul."""
    tokens, heads, kv_heads, head_dim = 6, 4, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    _, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    assert not k.is_contiguous()
    slots = torch.tensor([3, 0, 17, -1, 8, 30])
    expected_k, expected_v = torch.zeros(8, 4, kv_heads, head_dim), torch.zeros(8, 4, kv_heads, head_dim)
    torch_ref.write_kv_cache(k, v, expected_k, expected_v, slots)
    k_cache, v_cache = expected_k.new_zeros(expected_k.shape).to(DEVICE), expected_v.new_zeros(expected_v.shape).to(DEVICE)
    triton_attention.write_kv_cache(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    assert torch.equal(k_cache.cpu(), expected_k) and torch.equal(v_cache.cpu(), expected_v)


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


# ----------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads,qpk,head_dim,block_size", [(8, 4, 128, 16), (8, 8, 64, 32), (32, 1, 128, 16)])
def test_paged_attention_real_shapes_gpu(dtype, kv_heads, qpk, head_dim, block_size):
    query_lens = [1] * 30 + [300, 77, 512]
    context_lens = [500 + 13 * i for i in range(30)] + [0, 1000, 3000]
    query, keys, values, k_cache, v_cache, meta = written_batch(
        query_lens, context_lens, kv_heads, qpk, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    out = triton_attention.paged_attention(query, k_cache, v_cache, to_device(meta), scale)
    expected = dense_reference(query.cpu(), keys, values, meta, qpk, scale)
    torch.testing.assert_close(out.float().cpu(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cache_offsets_past_int32_gpu():
    """A cache of more than 2**31 elements (4 GiB of fp16): blocks near its end
    are only reachable with 64-bit offsets, in both the write and the read."""
    block_size, kv_heads, head_dim = 16, 8, 128
    per_block = block_size * kv_heads * head_dim
    num_blocks = 2**31 // per_block + 64
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=torch.float16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    top = num_blocks - 3  # its first element sits past 2**31
    seq_len = 2 * block_size
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(seq_len, kv_heads, head_dim, generator=g).half()
    values = torch.randn(seq_len, kv_heads, head_dim, generator=g).half()
    table = torch.tensor([[top, top + 1]], dtype=torch.int32)
    pos = torch.arange(seq_len)
    slots = table[0, pos // block_size].long() * block_size + pos % block_size
    triton_attention.write_kv_cache(keys.cuda(), values.cuda(), k_cache, v_cache, slots.cuda())
    assert torch.equal(k_cache[top].cpu(), keys[:block_size]) and k_cache[:top].count_nonzero() == 0
    query = torch.randn(1, kv_heads * 2, head_dim, generator=g).half()
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64), query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32), block_tables=table, max_query_len=1,
        max_seq_len=seq_len, query_start_loc_cpu=[0, 1], seq_lens_cpu=[seq_len],
    )
    out = triton_attention.paged_attention(query.cuda(), k_cache, v_cache, to_device(meta), head_dim**-0.5)
    expected = dense_reference(query, [keys], [values], meta, 2, head_dim**-0.5)
    torch.testing.assert_close(out.float().cpu(), expected, atol=3e-3, rtol=3e-3)
