"""Triton kernels for the GPU path: paged KV-cache write and paged attention.

Attention serves a mixed batch in one launch: each program takes a tile of
one request's query tokens and *all* query heads that share one KV head
(GQA packing), so every K/V page is read once per KV head rather than once
per query head, and decode tiles (one token) still fill the 16-row minimum
of ``tl.dot``. It walks the request's block table with an online softmax
(flash-attention style) and masks causally against the cached prefix: query
``i`` of a request sits at position ``seq_len - query_len + i``.

Under ``TRITON_INTERPRET=1`` these run on CPU tensors, which is how the test
suite checks them against the torch reference on machines without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.metadata import AttentionMetadata


@triton.jit
def _write_kv_kernel(
    key, value, k_cache, v_cache, slot_mapping,
    stride_kt, stride_vt, stride_cb, stride_cs,
    block_size: tl.constexpr, ROW: tl.constexpr, ROW_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    # int64: slot * row size overflows int32 in caches over 2**31 elements.
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot < 0:  # padding token (e.g. a CUDA-graph batch filler)
        return
    offs = tl.arange(0, ROW_PAD)
    mask = offs < ROW
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + offs
    tl.store(k_cache + dst, tl.load(key + t * stride_kt + offs, mask=mask), mask=mask)
    tl.store(v_cache + dst, tl.load(value + t * stride_vt + offs, mask=mask), mask=mask)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T, Hkv, D] -> caches [num_blocks, block_size, Hkv, D] at ``slot_mapping``.

    Each token's Hkv * D values are copied as one row, so key and value may
    be strided over tokens (slices of a fused qkv projection are) but each
    token's heads must be contiguous, as must each cache slot.
    """
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _rows_contiguous(key), _rows_contiguous(value)
    assert k_cache.stride(3) == 1 and k_cache.stride(2) == head_dim and k_cache.stride() == v_cache.stride()
    row = kv_heads * head_dim
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), value.stride(0), k_cache.stride(0), k_cache.stride(1),
        block_size=k_cache.shape[1], ROW=row, ROW_PAD=triton.next_power_of_2(row),
    )


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] as is when each x[t] is one contiguous row, else a contiguous copy."""
    rows_ok = x.stride(2) == 1 and (x.stride(1) == x.shape[2] or x.shape[1] == 1)
    return x if rows_ok else x.contiguous()


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache, v_cache, out_ptr, block_tables, seq_lens, query_start_loc, scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    QPK: tl.constexpr, QPK_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)

    q_start = tl.load(query_start_loc + req)
    q_len = tl.load(query_start_loc + req + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens + req)
    context_start = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * QPK_PAD
    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // QPK_PAD  # query token within the request
    head = kv_head * QPK + rows % QPK_PAD
    row_ok = (tok < q_len) & (rows % QPK_PAD < QPK)
    q_pos = context_start + tok

    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # Keys past the tile's last query position are masked anyway: stop there.
    kv_end = tl.minimum(seq_len, context_start + (q_tile + 1) * BLOCK_Q)
    # A sliding window (window > 0): keys before the tile's first query's window are never seen.
    kv_begin = 0
    if window > 0:
        kv_begin = tl.maximum(context_start + q_tile * BLOCK_Q - window + 1, 0) // BLOCK_N * BLOCK_N
    for start in range(kv_begin, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        # int64: page * stride_cb overflows int32 once the cache passes 2**31 elements.
        page = tl.load(block_tables + req * stride_bt + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        kv_off = page[:, None] * stride_cb + (n % PAGE)[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache + kv_off, mask=kv_mask, other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if window > 0:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet (a tile wholly before its window) keeps a zero sum.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def paged_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None, window: int = 0,
) -> torch.Tensor:
    """query [T, Hq, D] against the paged cache (this step's K/V already written); with a
    sliding ``window`` > 0 each query sees the last ``window`` positions up to its own."""
    num_tokens, num_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    qpk = num_heads // kv_heads
    qpk_pad = triton.next_power_of_2(qpk)
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    assert query.stride(2) == 1 and out.stride(2) == 1 and k_cache.stride(3) == 1
    assert k_cache.stride() == v_cache.stride()
    # Rows per tile must reach 16 for tl.dot; decode tiles hold one token.
    block_q = max(16 // qpk_pad, 1) if meta.max_query_len == 1 else max(64 // qpk_pad, 1)
    grid = (meta.num_reqs, kv_heads, triton.cdiv(meta.max_query_len, block_q))
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, window,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        QPK=qpk, QPK_PAD=qpk_pad, BLOCK_Q=block_q, BLOCK_N=max(16, k_cache.shape[1]),
        PAGE=k_cache.shape[1], HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        # fp32 models get exact fp32 products (no TF32) so they match the CPU path.
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out
